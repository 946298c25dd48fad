#include "kmla/checkpoint.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "kmla/error.hpp"

namespace kmla {

namespace fs = std::filesystem;

void write_safetensors(const std::string& path, const std::vector<StWriteTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::set<std::string> seen;
  for (const StWriteTensor& t : tensors) {
    KMLA_CHECK(seen.insert(t.name).second, path, ": tensor '", t.name, "' given twice");
    uint64_t n = 1;
    for (int64_t d : t.shape) {
      KMLA_CHECK(d >= 0, path, ": tensor '", t.name, "' has a negative dimension ", d);
      n *= uint64_t(d);
    }
    const uint64_t bytes = n * st_dtype_size(t.dtype);
    KMLA_CHECK(t.data != nullptr || bytes == 0, path, ": tensor '", t.name, "' has no data");
    header[t.name] = {{"dtype", st_dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  KMLA_CHECK(out.good(), "cannot write ", path);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out.put(char((n >> (8 * i)) & 0xff));
  out.write(text.data(), std::streamsize(text.size()));
  for (const StWriteTensor& t : tensors) {
    uint64_t count = 1;
    for (int64_t d : t.shape) count *= uint64_t(d);
    out.write(static_cast<const char*>(t.data), std::streamsize(count * st_dtype_size(t.dtype)));
  }
  KMLA_CHECK(out.good(), "writing ", path, " failed");
}

Checkpoint Checkpoint::open(const std::string& dir) {
  Checkpoint c;
  c.dir_ = dir;
  KMLA_CHECK(fs::is_directory(dir), dir, ": not a directory");
  c.config_ = load_hf_config(dir);

  std::vector<std::string> files;
  std::map<std::string, std::string> index;  // tensor -> file, when sharded
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index_path)) {
    std::ifstream in(index_path);
    std::stringstream ss;
    ss << in.rdbuf();
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(ss.str());
    } catch (const nlohmann::json::exception& e) {
      KMLA_CHECK(false, index_path.string(), ": invalid JSON: ", e.what());
    }
    KMLA_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), index_path.string(),
               ": missing the weight_map object");
    std::set<std::string> unique;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      KMLA_CHECK(it.value().is_string(), index_path.string(), ": weight_map entry '", it.key(), "' is not a file name");
      const std::string file = it.value().get<std::string>();
      KMLA_CHECK(file.find('/') == std::string::npos && file.find("..") == std::string::npos, index_path.string(),
                 ": weight_map entry '", it.key(), "' names a file outside the directory: ", file);
      index[it.key()] = file;
      unique.insert(file);
    }
    files.assign(unique.begin(), unique.end());
  } else {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".safetensors") files.push_back(e.path().filename().string());
    std::sort(files.begin(), files.end());
  }
  KMLA_CHECK(!files.empty(), dir, ": no .safetensors files");
  for (const std::string& f : files) {
    const std::string path = (fs::path(dir) / f).string();
    c.files_.push_back(std::make_shared<SafetensorsFile>(SafetensorsFile::open(path)));
    for (const std::string& name : c.files_.back()->names()) {
      const auto [it, fresh] = c.where_.insert({name, {c.files_.size() - 1, path}});
      KMLA_CHECK(fresh, dir, ": tensor '", name, "' appears in both ", it->second.second, " and ", path);
    }
  }
  for (const auto& [name, file] : index) {
    auto it = c.where_.find(name);
    KMLA_CHECK(it != c.where_.end(), index_path.string(), ": tensor '", name, "' is listed in ", file,
               " but that file does not hold it");
    KMLA_CHECK(fs::path(it->second.second).filename() == file, index_path.string(), ": tensor '", name,
               "' is listed in ", file, " but found in ", it->second.second);
  }
  return c;
}

const StTensor& Checkpoint::tensor(const std::string& name) const {
  auto it = where_.find(name);
  KMLA_CHECK(it != where_.end(), dir_, ": missing tensor '", name, "'");
  return files_[it->second.first]->tensor(name);
}

const std::string& Checkpoint::file_of(const std::string& name) const {
  auto it = where_.find(name);
  KMLA_CHECK(it != where_.end(), dir_, ": missing tensor '", name, "'");
  return it->second.second;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> n;
  for (const auto& [k, v] : where_) n.push_back(k);
  return n;
}

std::string Checkpoint::attention_prefix(int layer) const {
  const std::string plain = "model.layers." + std::to_string(layer) + ".self_attn.";
  for (const std::string& p : {plain, "language_model." + plain}) {
    auto it = where_.lower_bound(p);
    if (it != where_.end() && it->first.compare(0, p.size(), p) == 0) return p;
  }
  KMLA_CHECK(false, dir_, ": no attention tensors for layer ", layer, " (looked for '", plain,
             "*' and 'language_model.", plain, "*')");
  return plain;
}

}  // namespace kmla
