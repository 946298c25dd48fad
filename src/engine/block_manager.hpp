// The block manager over the paged latent cache: which cache blocks are free, which belong to
// which requests (reference counts), and which hold a full block of a prompt prefix that a
// later request may reuse (the prefix cache).
//
// One block id names the same block in every layer's cache (one block table per request
// serves the whole stack), so the manager counts blocks once; bytes are blocks x block_size x
// entry bytes x layers.
//
// A block is in exactly one of three states:
//   free    ref 0, no cached content           (a FIFO queue)
//   cached  ref 0, content published by hash   (evictable, least recently used first)
//   used    ref >= 1                           (possibly published too: shared by hits)
// Only full blocks are ever published, so a partially filled block is never shared: its
// owner keeps writing into it.
#pragma once

#include <cstdint>
#include <deque>
#include <list>
#include <unordered_map>
#include <vector>

namespace kmla::engine {

class BlockManager {
 public:
  BlockManager(int64_t num_blocks, int block_size, bool prefix_caching);

  int64_t num_blocks() const { return int64_t(blocks_.size()); }
  int block_size() const { return block_size_; }
  bool prefix_caching() const { return prefix_caching_; }

  int64_t num_free() const { return int64_t(free_.size()); }
  int64_t num_cached() const { return int64_t(lru_.size()); }
  int64_t num_used() const { return num_blocks() - num_free() - num_cached(); }
  // Blocks a request could get now: free ones plus evictable cached ones.
  int64_t num_available() const { return num_free() + num_cached(); }
  int64_t evictions() const { return evictions_; }

  int ref_count(int32_t block) const;
  bool is_published(int32_t block) const;  // holds a full block registered by hash

  // The chain hash of a full block: it names the block's tokens and everything before them.
  static uint64_t chain_hash(uint64_t parent, const int32_t* tokens, int n);
  static constexpr uint64_t kRootHash = 0x6b6d6c61u;  // the parent of a sequence's first block

  // The cached full blocks that start `tokens`, at most `max_blocks` of them, in order. Takes
  // no reference (acquire() does). Empty when prefix caching is off.
  std::vector<int32_t> match_prefix(const std::vector<int32_t>& tokens, int64_t max_blocks) const;
  // One more reference to a block found by match_prefix (a cached block stops being evictable).
  void acquire(int32_t block);
  // A block with ref 1 for new content: a free block, else the least recently used cached
  // block (evicted: its hash is forgotten). -1 when every block is in use.
  int32_t allocate();
  // One reference less. At zero a published block becomes cached (most recently used), any
  // other block free.
  void release(int32_t block);
  // Publishes a full block (block_size tokens) under chain_hash(parent, tokens). False when
  // prefix caching is off or another block already holds the same content (two requests
  // computed it at once): this block then stays private and is freed with its owner.
  bool publish(int32_t block, uint64_t parent, const int32_t* tokens);

  // Throws kmla::Error if the counts or the maps disagree (tests and the engine's final check).
  void check_invariants() const;

 private:
  struct Block {
    int ref = 0;
    bool published = false;
    uint64_t hash = 0;
    uint64_t parent = 0;
    std::vector<int32_t> tokens;           // the published content (verified on a match)
    std::list<int32_t>::iterator lru_pos;  // valid while cached
  };
  void check_id(int32_t block) const;

  int block_size_;
  bool prefix_caching_;
  std::vector<Block> blocks_;
  std::deque<int32_t> free_;
  std::list<int32_t> lru_;  // cached blocks, least recently used first
  std::unordered_map<uint64_t, int32_t> by_hash_;
  int64_t evictions_ = 0;
};

}  // namespace kmla::engine
