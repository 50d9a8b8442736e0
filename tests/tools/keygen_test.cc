// rd2h keygen as an operator runs it: the pair it writes is what a connector's
// kv_connector_extra_config names, and an existing key is never overwritten.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "control/curve.h"
#include "rd2h/connector/config.h"
#include "support/rd2h_run.h"

namespace rd2h {
namespace {

class Keygen : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "rd2h-keygen-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // The public key `rd2h keygen` printed.
  static std::string printed_key(const std::string& output) {
    const std::string mark = "public key ";
    const size_t at = output.find(mark);
    return at == std::string::npos ? "" : output.substr(at + mark.size(), control::kCurveKeyChars);
  }
  std::string dir_;
};

TEST_F(Keygen, WritesAPairAConnectorOffLoopbackRunsWith) {
  const ToolRun decode = run_rd2h({"keygen", dir_ + "/decode"});
  ASSERT_EQ(decode.exit_code, 0) << decode.output;
  const ToolRun prefill = run_rd2h({"keygen", dir_ + "/prefill"});
  ASSERT_EQ(prefill.exit_code, 0) << prefill.output;
  struct stat st {};
  ASSERT_EQ(::stat((dir_ + "/decode.key_secret").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "the secret key is readable by others";

  // A Decode on a non-loopback address starts with its own secret key and the Prefill's
  // public certificate, and presents the key keygen printed.
  auto config = connector::ConnectorConfig::from_json(
      R"({"kv_connector": "rd2h", "kv_role": "kv_consumer", "kv_port": 30000,
          "kv_ip": "10.1.2.3", "kv_connector_extra_config": {"curve_secret_key_file": ")" +
      dir_ + R"(/decode.key_secret", "curve_trusted_keys_file": ")" + dir_ + R"(/prefill.key"}})");
  ASSERT_TRUE(config) << config.status().to_string();
  EXPECT_EQ(config->curve.public_key, printed_key(decode.output)) << decode.output;
  EXPECT_EQ(config->curve.trusted, std::vector<std::string>{printed_key(prefill.output)});
}

TEST_F(Keygen, AnExistingKeyIsNeverOverwritten) {
  ASSERT_EQ(run_rd2h({"keygen", dir_ + "/decode"}).exit_code, 0);
  auto before = control::read_secret_key_file(dir_ + "/decode.key_secret");
  ASSERT_TRUE(before) << before.status().to_string();
  const ToolRun again = run_rd2h({"keygen", dir_ + "/decode"});
  EXPECT_NE(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("never overwritten"), std::string::npos) << again.output;
  auto after = control::read_secret_key_file(dir_ + "/decode.key_secret");
  ASSERT_TRUE(after) << after.status().to_string();
  EXPECT_EQ(after->secret_key, before->secret_key);
}

}  // namespace
}  // namespace rd2h
