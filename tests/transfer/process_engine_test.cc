#include <gtest/gtest.h>

#include "rd2h/transfer/transfer_engine.h"

namespace rd2h::transfer {
namespace {

class ProcessEngine : public ::testing::Test {
 protected:
  void TearDown() override { unbind_process_engine(); }
  static EngineConfig base() {
    EngineConfig c;
    c.role = Role::kDecode;
    c.device_id = 3;
    c.hostname = "decode-host";
    c.transport = Transport::kShm;
    return c;
  }
};

TEST_F(ProcessEngine, BindingAgainWithSameValuesReturnsTheSameEngine) {
  auto a = bind_process_engine(base());
  ASSERT_TRUE(a) << a.status().to_string();
  auto b = bind_process_engine(base());
  ASSERT_TRUE(b);
  EXPECT_EQ(a->get(), b->get());
}

TEST_F(ProcessEngine, BindingWithADifferentValueNamesIt) {
  ASSERT_TRUE(bind_process_engine(base()));
  struct Case {
    void (*change)(EngineConfig&);
    const char* names;
  };
  const Case cases[] = {
      {[](EngineConfig& c) { c.role = Role::kPrefill; }, "role decode; cannot bind it to prefill"},
      {[](EngineConfig& c) { c.device_id = 4; }, "device id 3; cannot bind it to 4"},
      {[](EngineConfig& c) { c.hostname = "other"; },
       "hostname decode-host; cannot bind it to other"},
      {[](EngineConfig& c) { c.transport = Transport::kTcp; },
       "transport shm; cannot bind it to tcp"},
  };
  for (const auto& c : cases) {
    EngineConfig cfg = base();
    c.change(cfg);
    auto e = bind_process_engine(cfg);
    ASSERT_FALSE(e) << c.names;
    EXPECT_EQ(e.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(e.status().message().find(c.names), std::string::npos) << e.status().message();
  }
}

TEST_F(ProcessEngine, UnbindingAllowsANewBinding) {
  ASSERT_TRUE(bind_process_engine(base()));
  unbind_process_engine();
  EngineConfig other = base();
  other.role = Role::kPrefill;
  auto e = bind_process_engine(other);
  ASSERT_TRUE(e) << e.status().to_string();
  EXPECT_EQ((*e)->config().role, Role::kPrefill);
}

}  // namespace
}  // namespace rd2h::transfer
