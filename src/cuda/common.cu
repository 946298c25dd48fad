#include "cuda/common.cuh"

namespace kmla::cuda {

CacheRef cache_ref(const LatentCache& cache) {
  KMLA_CHECK(cache.device() == Device::cuda, "the CUDA backend needs a cache in device memory, got a ",
             device_name(cache.device()), " cache");
  CacheRef r;
  r.base = cache.base();
  r.block_stride = cache.geometry().block_stride;
  r.block_size = cache.block_size();
  r.num_blocks = cache.num_blocks();
  r.format = cache.format();
  r.k_scale = cache.k_scale();
  r.tile_rule = cache.codec().tile_rule;
  return r;
}

}  // namespace kmla::cuda
