// DeviceEnv's budget without a GPU: a stand-in for the raw device memory records what is
// allocated and freed; draws of puts, links and the GPU tier share each device's budget, a draw
// past it is ResourceExhausted with nothing allocated, a failed allocation gives its draw back,
// memory is freed and its draw returned with its last holder, and engines of one set draw from
// one env.
#include "device_env.h"

#include <memory>
#include <set>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "engine.h"
#include "gtest/gtest.h"

namespace kvcomp {
namespace service {
namespace {

using Drawer = DeviceEnv::Drawer;

struct Ledger {
  absl::Mutex mu;
  std::set<std::pair<int, void*>> live;
  int allocs = 0, frees = 0;
  bool fail_next = false;
};

class FakeMemory : public DeviceEnv::Memory {
 public:
  explicit FakeMemory(Ledger* l) : l_(l) {}
  absl::StatusOr<void*> Alloc(int device, size_t bytes) override {
    absl::MutexLock lock(&l_->mu);
    if (l_->fail_next) {
      l_->fail_next = false;
      return absl::ResourceExhaustedError("out of device memory");
    }
    void* p = ::operator new(bytes);
    l_->live.insert({device, p});
    ++l_->allocs;
    return p;
  }
  void Free(int device, void* ptr) override {
    absl::MutexLock lock(&l_->mu);
    EXPECT_EQ(l_->live.erase({device, ptr}), 1u) << "freed on another device or twice";
    ++l_->frees;
    ::operator delete(ptr);
  }
  absl::StatusOr<void*> AllocPinned(int device, size_t bytes) override {
    return Alloc(-2 - device, bytes);  // host memory for `device`: its own key in the ledger
  }
  void FreePinned(int device, void* ptr) override { Free(-2 - device, ptr); }

 private:
  Ledger* l_;
};

TEST(DeviceEnvTest, PutsAndLinksShareEachDevicesBudget) {
  Ledger ledger;
  DeviceEnv env(1000, std::make_unique<FakeMemory>(&ledger));
  EXPECT_EQ(env.budget_bytes(), 1000u);
  absl::StatusOr<DeviceEnv::Grant> put = env.Reserve(0, 600, Drawer::kPuts);
  ASSERT_TRUE(put.ok()) << put.status();
  absl::StatusOr<std::shared_ptr<uint8_t>> buf = env.Allocate(0, 300, Drawer::kLinks);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_EQ(env.held_bytes(0, Drawer::kPuts), 600u);
  EXPECT_EQ(env.held_bytes(0, Drawer::kLinks), 300u);
  EXPECT_EQ(env.held_bytes(0), 900u);
  EXPECT_EQ(ledger.allocs, 1);  // a reservation only counts
  // The GPU tier's pool draws from the same budget.
  EXPECT_TRUE(absl::IsResourceExhausted(env.Reserve(0, 200, Drawer::kGpuTier).status()));
  absl::StatusOr<DeviceEnv::Grant> tier = env.Reserve(0, 50, Drawer::kGpuTier);
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_EQ(env.held_bytes(0, Drawer::kGpuTier), 50u);
  EXPECT_TRUE(absl::IsResourceExhausted(env.Reserve(0, 51, Drawer::kPuts).status()));
  *tier = DeviceEnv::Grant();
  EXPECT_EQ(env.held_bytes(0, Drawer::kGpuTier), 0u);

  // Past the budget, for either drawer: refused, nothing allocated, nothing held.
  absl::StatusOr<std::shared_ptr<uint8_t>> more = env.Allocate(0, 101, Drawer::kLinks);
  EXPECT_TRUE(absl::IsResourceExhausted(more.status())) << more.status();
  EXPECT_TRUE(absl::IsResourceExhausted(env.Reserve(0, 101, Drawer::kPuts).status()));
  EXPECT_EQ(ledger.allocs, 1);
  EXPECT_EQ(env.held_bytes(0), 900u);
  // Exactly what is left fits; another device has a budget of its own.
  EXPECT_TRUE(env.Reserve(0, 100, Drawer::kPuts).ok());  // given back at once
  absl::StatusOr<DeviceEnv::Grant> other = env.Reserve(1, 1000, Drawer::kPuts);
  EXPECT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(env.held_bytes(1), 1000u);
  EXPECT_EQ(env.held_bytes(0), 900u);

  // Memory goes back with its last holder, its draw with it.
  std::shared_ptr<uint8_t> second = *buf;
  buf->reset();
  EXPECT_EQ(ledger.frees, 0);
  second.reset();
  EXPECT_EQ(ledger.frees, 1);
  EXPECT_EQ(env.held_bytes(0, Drawer::kLinks), 0u);
  // A grant moved keeps its draw once; ending it returns it.
  DeviceEnv::Grant moved = *std::move(put);
  EXPECT_EQ(moved.bytes(), 600u);
  EXPECT_EQ(env.held_bytes(0, Drawer::kPuts), 600u);
  moved = DeviceEnv::Grant();
  EXPECT_EQ(env.held_bytes(0), 0u);
  other = DeviceEnv::Grant();
  EXPECT_EQ(env.held_bytes(1), 0u);
  EXPECT_TRUE(ledger.live.empty());
}

TEST(DeviceEnvTest, AFailedAllocationGivesItsDrawBack) {
  Ledger ledger;
  DeviceEnv env(1000, std::make_unique<FakeMemory>(&ledger));
  ledger.fail_next = true;
  absl::StatusOr<std::shared_ptr<uint8_t>> buf = env.Allocate(2, 500, Drawer::kLinks);
  EXPECT_TRUE(absl::IsResourceExhausted(buf.status())) << buf.status();
  EXPECT_EQ(env.held_bytes(2), 0u);
  buf = env.Allocate(2, 1000, Drawer::kLinks);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_EQ(env.held_bytes(2), 1000u);
  buf->reset();
  EXPECT_EQ(env.held_bytes(2), 0u);
  EXPECT_EQ(ledger.frees, 1);
}

TEST(DeviceEnvTest, NoBudgetCountsButNeverRefuses) {
  Ledger ledger;
  DeviceEnv env(0, std::make_unique<FakeMemory>(&ledger));
  absl::StatusOr<DeviceEnv::Grant> big = env.Reserve(0, uint64_t{1} << 50, Drawer::kPuts);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(env.held_bytes(0, Drawer::kPuts), uint64_t{1} << 50);
  // Device -1 (a CPU engine's accounting) never has a budget.
  DeviceEnv capped(10, std::make_unique<FakeMemory>(&ledger));
  absl::StatusOr<DeviceEnv::Grant> cpu = capped.Reserve(-1, 100, Drawer::kPuts);
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(capped.held_bytes(-1), 100u);
}

// The daemon lets go of its engines (and with them its last owner of the env) while GPU
// channels and the GPU tier's draw still hold memory and grants: they keep the env alive, so
// their memory is freed through it and their draws returned to it, in any order.
TEST(DeviceEnvTest, GrantsAndMemoryOutliveTheEnvsOwners) {
  Ledger ledger;
  auto env = std::make_shared<DeviceEnv>(1000, std::make_unique<FakeMemory>(&ledger));
  absl::StatusOr<DeviceEnv::Grant> tier = env->Reserve(0, 400, Drawer::kGpuTier);
  ASSERT_TRUE(tier.ok()) << tier.status();
  absl::StatusOr<std::shared_ptr<uint8_t>> buf = env->Allocate(0, 300, Drawer::kLinks);
  ASSERT_TRUE(buf.ok()) << buf.status();
  std::weak_ptr<DeviceEnv> weak = env;
  env.reset();
  ASSERT_FALSE(weak.expired()) << "the grants must keep the env alive";
  EXPECT_EQ(weak.lock()->held_bytes(0), 700u);
  buf->reset();
  {
    absl::MutexLock lock(&ledger.mu);
    EXPECT_EQ(ledger.frees, 1);
    EXPECT_TRUE(ledger.live.empty());
  }
  ASSERT_FALSE(weak.expired());
  EXPECT_EQ(weak.lock()->held_bytes(0), 400u);
  *tier = DeviceEnv::Grant();
  EXPECT_TRUE(weak.expired()) << "the last grant's end lets the env go";
}

TEST(DeviceEnvTest, AnEngineDrawsItsPutsFromTheEnvItIsGiven) {
  Ledger ledger;
  auto env = std::make_shared<DeviceEnv>(1000, std::make_unique<FakeMemory>(&ledger));
  EngineOptions o;
  o.backend = "cpu";
  o.workers = 1;
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(o, 1.0, env);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ(&(*engine)->device_env(), env.get());
  // A CPU engine counts on device -1, with no budget.
  absl::StatusOr<Engine::DeviceReservation> r = (*engine)->ReserveDevice(5000);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*engine)->device_reserved_bytes(), 5000u);
  EXPECT_EQ(env->held_bytes(-1, Drawer::kPuts), 5000u);
  EXPECT_EQ((*engine)->device_cap_bytes(), 0u);
  *r = Engine::DeviceReservation();
  EXPECT_EQ((*engine)->device_reserved_bytes(), 0u);
  (*engine)->Shutdown();
}

// Page-locked host memory for a device's copies comes through the same env but draws nothing
// from the device's budget; it is freed, on its device, with its last holder.
TEST(DeviceEnvTest, PinnedMemoryIsAllocatedThroughTheEnvOutsideTheBudget) {
  Ledger ledger;
  DeviceEnv env(100, std::make_unique<FakeMemory>(&ledger));
  absl::StatusOr<std::shared_ptr<uint8_t>> pinned = env.AllocatePinned(1, 4096);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_EQ(env.held_bytes(1), 0u);
  EXPECT_TRUE(env.Allocate(1, 100, Drawer::kLinks).ok());
  EXPECT_EQ(ledger.allocs, 2);
  pinned->reset();
  EXPECT_EQ(ledger.frees, 2);
  EXPECT_TRUE(ledger.live.empty());
  ledger.fail_next = true;
  EXPECT_TRUE(absl::IsResourceExhausted(env.AllocatePinned(0, 16).status()));
}

}  // namespace
}  // namespace service
}  // namespace kvcomp
