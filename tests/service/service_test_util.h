// What the service's in-process tests share: a seeded K/V tensor, a put's blocks cut from it, a
// temporary directory, and a fixture holding an EngineSet (one engine, or several given ones), a
// CacheRepository over a real TieredStore (RocksDB in the temporary directory) and a
// CacheService, with its callback calls made synchronous.
#ifndef KVCOMP_TESTS_SERVICE_SERVICE_TEST_UTIL_H_
#define KVCOMP_TESTS_SERVICE_SERVICE_TEST_UTIL_H_

#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "cache_repository.h"
#include "cache_service.h"
#include "engine.h"
#include "engine_set.h"
#include "gtest/gtest.h"
#include "kvcomp/core/status.h"
#include "kvcomp/service/metrics.h"
#include "kvcomp/storage/tiered_store.h"
#include "kvsplice_glue.h"
#include "put.h"
#include "service_context.h"

namespace kvcomp {
namespace service {
namespace testutil {

// K and V of every layer, [layer][head][token][dim] each, from a seeded generator (float32).
struct KvTensor {
  KvLayout layout;
  uint64_t tokens;
  std::vector<float> keys, values;

  KvTensor(const KvLayout& layout_in, uint64_t tokens_in, uint64_t seed)
      : layout(layout_in), tokens(tokens_in) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n(0.f, 1.f);
    const size_t count = size_t{layout.num_layers} * layout.num_kv_heads * tokens * layout.head_dim;
    keys.resize(count);
    values.resize(count);
    for (float& x : keys) x = n(rng);
    for (float& x : values) x = n(rng);
  }
  const float* at(const std::vector<float>& t, uint32_t layer, uint32_t head,
                  uint64_t token) const {
    return t.data() +
           ((uint64_t{layer} * layout.num_kv_heads + head) * tokens + token) * layout.head_dim;
  }
  KvCacheView View() const {
    KvCacheView v;
    v.layout = layout;
    v.num_tokens = tokens;
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
      v.keys.push_back(HeadsView::Dense(at(keys, l, 0, 0), layout.dtype, layout.num_kv_heads,
                                        tokens, layout.head_dim));
      v.values.push_back(HeadsView::Dense(at(values, l, 0, 0), layout.dtype, layout.num_kv_heads,
                                          tokens, layout.head_dim));
    }
    return v;
  }
};

// A block of tokens [t0, t1) of layers [l0, l1), copied into its own memory laid out as the
// blocks of a put are ([layer][head][token][dim] per part). `released` is set when the block's
// memory goes.
inline BlockData MakeBlock(const KvTensor& x, uint32_t l0, uint32_t l1, uint64_t t0, uint64_t t1,
                           bool keys = true, bool values = true,
                           std::shared_ptr<std::atomic<bool>> released = nullptr) {
  const uint64_t n = t1 - t0;
  const uint32_t H = x.layout.num_kv_heads, D = x.layout.head_dim;
  auto buf = std::make_shared<std::vector<float>>(2 * size_t{l1 - l0} * H * n * D);
  float* k = buf->data();
  float* v = k + size_t{l1 - l0} * H * n * D;
  BlockData b;
  b.layer_begin = l0;
  b.layer_end = l1;
  b.token_begin = t0;
  b.token_end = t1;
  for (uint32_t l = l0; l < l1; ++l) {
    float* kl = k + size_t{l - l0} * H * n * D;
    float* vl = v + size_t{l - l0} * H * n * D;
    for (uint32_t h = 0; h < H; ++h) {
      std::copy(x.at(x.keys, l, h, t0), x.at(x.keys, l, h, t0) + n * D, kl + h * n * D);
      std::copy(x.at(x.values, l, h, t0), x.at(x.values, l, h, t0) + n * D, vl + h * n * D);
    }
    if (keys) b.keys.push_back(HeadsView::Dense(kl, x.layout.dtype, H, n, D));
    if (values) b.values.push_back(HeadsView::Dense(vl, x.layout.dtype, H, n, D));
  }
  b.bytes = ((keys ? 1 : 0) + (values ? 1 : 0)) * size_t{l1 - l0} * H * n * D * sizeof(float);
  if (released == nullptr) {
    b.memory = buf;
  } else {
    b.memory = std::shared_ptr<void>(buf.get(), [buf, released](void*) mutable {
      buf.reset();
      released->store(true);
    });
  }
  return b;
}

// A fresh directory under the system's temporary one, removed with everything in it at the end;
// path() is empty where none could be made.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kvcomp_service_XXXXXX").string();
    path_ = mkdtemp(tmpl.data()) != nullptr ? tmpl : std::string();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The service over a real store. Open() builds it (RocksDB under the temporary directory) with
// the engines EngineSet::Create makes from `eo` (one per eo.cuda_devices on GPUs), or, with
// `engines` > 1, that many engines each made from `eo` (several CPU engines standing in for
// several GPUs); engine_ is the first. TearDown() shuts it down and may be followed by another
// Open().
class ServiceFixture : public ::testing::Test {
 protected:
  void Open(storage::StoreOptions so, const EngineOptions& eo, const RepositoryOptions& ro,
            const ServiceOptions& svo, int engines = 1) {
    ASSERT_FALSE(dir_.path().empty());
    so.rocksdb.path = dir_.path() + "/rocksdb";
    auto store = storage::TieredStore::Open(so);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    metrics_ = std::make_unique<Metrics>("test", eo.backend);
    projections_ = std::make_unique<codecs::TieredProjectionStore>(store_.get());
    if (engines == 1) {
      auto set = EngineSet::Create(eo);
      ASSERT_TRUE(set.ok()) << set.status();
      engines_ = std::move(*set);
    } else {
      std::vector<std::unique_ptr<Engine>> made;
      for (int i = 0; i < engines; ++i) {
        auto engine = Engine::Create(eo);
        ASSERT_TRUE(engine.ok()) << engine.status();
        made.push_back(*std::move(engine));
      }
      engines_ = std::make_unique<EngineSet>(std::move(made));
    }
    engine_ = &engines_->primary();
    repository_ =
        std::make_unique<CacheRepository>(ro, store_.get(), projections_.get(), metrics_.get());
    service_ =
        std::make_unique<CacheService>(svo, engines_.get(), repository_.get(), metrics_.get());
  }
  void TearDown() override {
    if (service_) service_->Shutdown();
    service_.reset();
    repository_.reset();
    engine_ = nullptr;
    engines_.reset();
    store_.reset();
  }

  absl::Status Add(OpenPut& put, BlockData block) {
    absl::Status out = absl::UnknownError("not done");
    put.AddBlock(std::move(block), [&](absl::Status s) { out = s; });  // runs inside AddBlock
    return out;
  }
  absl::StatusOr<CacheSummary> Commit(OpenPut& put) {
    absl::StatusOr<CacheSummary> out = absl::UnknownError("not done");
    absl::Notification done;
    put.Commit([&](absl::StatusOr<CacheSummary> r) {
      out = std::move(r);
      done.Notify();
    });
    done.WaitForNotification();
    return out;
  }
  // Fits alice's orthogonal_int8 projection of `rank` for model "m" from the raw caches put so
  // far, as a daemon's calibration call does.
  absl::Status CalibrateOrthogonalInt8(uint32_t rank) {
    CalibrationRequest cr;
    cr.tenant = "alice";
    cr.model_id = "m";
    cr.value_codec = std::string(ValueCodecName(ValueCodec::kOrthogonalInt8));
    cr.rank = rank;
    return CalibrateFromStore(store_.get(), projections_.get(), cr).status();
  }
  // A sample's value in a Prometheus scrape (`name` with its labels), `missing` when absent.
  static double Scraped(const std::string& text, const std::string& name, double missing) {
    const size_t at = text.find("\n" + name + " ");
    return at == std::string::npos ? missing : std::stod(text.substr(at + name.size() + 2));
  }
  absl::StatusOr<storage::Payload> Get(const CacheKey& key,
                                       Representation rep = Representation::kStored) {
    absl::StatusOr<storage::Payload> out = absl::UnknownError("not done");
    absl::Notification done;
    service_->Get(key, rep, [&](absl::StatusOr<storage::Payload> r) {
      out = std::move(r);
      done.Notify();
    });
    done.WaitForNotification();
    return out;
  }

  TempDir dir_;
  std::unique_ptr<storage::TieredStore> store_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<codecs::TieredProjectionStore> projections_;
  std::unique_ptr<EngineSet> engines_;
  Engine* engine_ = nullptr;  // engines_->primary()
  std::unique_ptr<CacheRepository> repository_;
  std::unique_ptr<CacheService> service_;
};

}  // namespace testutil
}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_TESTS_SERVICE_SERVICE_TEST_UTIL_H_
