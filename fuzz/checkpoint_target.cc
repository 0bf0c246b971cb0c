#include "fuzz/checkpoint_target.h"

#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "core/error.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace r3 {

namespace {

// The safetensors reader takes a path: an in-memory regular file (memfd) rewritten per input.
struct MemFile {
  int fd = ::memfd_create("r3_fuzz_safetensors", MFD_CLOEXEC);
  std::string path = "/proc/self/fd/" + std::to_string(fd);
  void set(const uint8_t* data, size_t size) {
    if (fd < 0 || ::ftruncate(fd, 0) != 0) std::abort();
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::pwrite(fd, data + done, size - done, off_t(done));
      if (n <= 0) std::abort();
      done += size_t(n);
    }
  }
};

}  // namespace

void fuzz_checkpoint_readers(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const bool config = data[0] & 1;
  ++data;
  --size;
  try {
    if (config) {
      const ModelConfig c =
          parse_config(std::string(reinterpret_cast<const char*>(data), size), "fuzz/config.json");
      // A parsed config's derived sizes must be sane (the invariants the engine sizes buffers by).
      if (c.num_layers <= 0 || c.hidden_size <= 0 || c.head_dim <= 0 || c.num_kv_heads <= 0 ||
          c.num_heads % c.num_kv_heads != 0 || int(c.layers.size()) != c.num_layers ||
          c.top_k <= 0 || c.top_k > c.num_experts || !(c.rope_theta > 0.f) ||
          !(c.rms_norm_eps > 0.f))
        throw std::logic_error("parse_config accepted an inconsistent config");
    } else {
      static MemFile file;
      file.set(data, size);
      SafetensorsFile f(file.path);
      // Every tensor reads exactly what its shape says, from inside the file.
      for (auto& [name, t] : f.tensors()) {
        std::vector<uint8_t> bytes(t.nbytes() + 1, 0xA5);
        f.read_tensor(name, bytes.data());
        if (bytes.back() != 0xA5) throw std::logic_error("read_tensor wrote past the tensor");
      }
    }
  } catch (const Error&) {
    // The one expected way to refuse input.
  }
}

}  // namespace r3
