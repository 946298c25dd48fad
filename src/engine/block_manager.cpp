#include "engine/block_manager.hpp"

#include <algorithm>

#include "kmla/error.hpp"

namespace kmla::engine {

namespace {

// splitmix64's finaliser: a cheap, well-mixing 64-bit permutation.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

BlockManager::BlockManager(int64_t num_blocks, int block_size, bool prefix_caching)
    : block_size_(block_size), prefix_caching_(prefix_caching) {
  KMLA_CHECK(num_blocks >= 1 && num_blocks <= INT32_MAX, "the cache needs 1 to 2^31-1 blocks, got ",
             num_blocks);
  KMLA_CHECK(block_size >= 1 && block_size <= 1024, "block size must be in [1, 1024], got ", block_size);
  blocks_.resize(size_t(num_blocks));
  for (int64_t i = 0; i < num_blocks; ++i) free_.push_back(int32_t(i));
}

void BlockManager::check_id(int32_t block) const {
  KMLA_CHECK(block >= 0 && block < num_blocks(), "block id ", block, " is outside [0, ", num_blocks(), ")");
}

int BlockManager::ref_count(int32_t block) const {
  check_id(block);
  return blocks_[size_t(block)].ref;
}

bool BlockManager::is_published(int32_t block) const {
  check_id(block);
  return blocks_[size_t(block)].published;
}

uint64_t BlockManager::chain_hash(uint64_t parent, const int32_t* tokens, int n) {
  uint64_t h = mix64(parent ^ 0x9e3779b97f4a7c15ull);
  for (int i = 0; i < n; ++i) h = mix64(h + uint64_t(uint32_t(tokens[i])) + 0x632be59bd9b4e019ull);
  return h;
}

std::vector<int32_t> BlockManager::match_prefix(const std::vector<int32_t>& tokens,
                                                int64_t max_blocks) const {
  std::vector<int32_t> hits;
  if (!prefix_caching_) return hits;
  const int64_t full = std::min<int64_t>(max_blocks, int64_t(tokens.size()) / block_size_);
  uint64_t parent = kRootHash;
  for (int64_t b = 0; b < full; ++b) {
    const int32_t* t = tokens.data() + b * block_size_;
    const uint64_t h = chain_hash(parent, t, block_size_);
    const auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    // A 64-bit hash collision is unlikely, not impossible: compare what the block holds.
    const Block& blk = blocks_[size_t(it->second)];
    if (blk.parent != parent || !std::equal(blk.tokens.begin(), blk.tokens.end(), t)) break;
    hits.push_back(it->second);
    parent = h;
  }
  return hits;
}

void BlockManager::acquire(int32_t block) {
  check_id(block);
  Block& b = blocks_[size_t(block)];
  KMLA_CHECK(b.published, "block ", block, " holds no published prefix; only those are shared");
  if (b.ref == 0) lru_.erase(b.lru_pos);
  ++b.ref;
}

int32_t BlockManager::allocate() {
  int32_t id = -1;
  if (!free_.empty()) {
    id = free_.front();
    free_.pop_front();
  } else if (!lru_.empty()) {
    id = lru_.front();
    lru_.pop_front();
    Block& b = blocks_[size_t(id)];
    by_hash_.erase(b.hash);
    b.published = false;
    b.tokens.clear();
    ++evictions_;
  } else {
    return -1;
  }
  blocks_[size_t(id)].ref = 1;
  return id;
}

void BlockManager::release(int32_t block) {
  check_id(block);
  Block& b = blocks_[size_t(block)];
  KMLA_CHECK(b.ref > 0, "block ", block, " is released but holds no reference");
  if (--b.ref > 0) return;
  if (b.published) {
    b.lru_pos = lru_.insert(lru_.end(), block);
  } else {
    free_.push_back(block);
  }
}

bool BlockManager::publish(int32_t block, uint64_t parent, const int32_t* tokens) {
  check_id(block);
  Block& b = blocks_[size_t(block)];
  KMLA_CHECK(b.ref > 0, "block ", block, " is published but holds no reference");
  if (!prefix_caching_ || b.published) return b.published;
  const uint64_t h = chain_hash(parent, tokens, block_size_);
  if (!by_hash_.emplace(h, block).second) return false;
  b.published = true;
  b.hash = h;
  b.parent = parent;
  b.tokens.assign(tokens, tokens + block_size_);
  return true;
}

void BlockManager::check_invariants() const {
  int64_t used = 0, cached = 0, published = 0;
  for (const Block& b : blocks_) {
    KMLA_CHECK(b.ref >= 0, "a block has a negative reference count");
    if (b.ref > 0) ++used;
    else if (b.published) ++cached;
    if (b.published) ++published;
  }
  KMLA_CHECK(cached == num_cached(), "the LRU list holds ", num_cached(), " blocks, ", cached, " are cached");
  KMLA_CHECK(used + cached + num_free() == num_blocks(), "blocks do not add up: ", used, " used + ",
             cached, " cached + ", num_free(), " free != ", num_blocks());
  KMLA_CHECK(published == int64_t(by_hash_.size()), "the hash map holds ", by_hash_.size(),
             " blocks, ", published, " are published");
  for (int32_t id : free_)
    KMLA_CHECK(blocks_[size_t(id)].ref == 0 && !blocks_[size_t(id)].published, "free block ", id,
               " is referenced or published");
}

}  // namespace kmla::engine
