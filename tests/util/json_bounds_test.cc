// JSON from the network is measured in one SAX pass before a document is built: too deep
// or too heavy is refused naming the bound, and only text within both becomes a document.
#include "util/json_bounds.h"

#include <gtest/gtest.h>

namespace rd2h::http {
namespace {

using nlohmann::json;

std::string repeated(const std::string& item, size_t n) {
  std::string out = "[";
  for (size_t i = 0; i < n; ++i) out += (i == 0 ? "" : ",") + item;
  return out + "]";
}

TEST(JsonBounds, ABodyWithinTheBoundsIsParsedWhole) {
  auto j = parse_bounded<json>(R"({"prompt": [[1, 2, 3]], "max_tokens": 8, "stream": true})");
  ASSERT_TRUE(j) << j.status().to_string();
  EXPECT_EQ((*j)["prompt"][0][2], 3);
  EXPECT_EQ((*j)["max_tokens"], 8);
}

TEST(JsonBounds, TooDeepIsRefusedNamingTheDepth) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  auto j = parse_bounded<json>(deep);
  ASSERT_FALSE(j);
  EXPECT_EQ(j.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(j.status().message(), "the body nests arrays and objects deeper than 64 levels");
  EXPECT_TRUE(parse_bounded<json>(std::string(64, '[') + std::string(64, ']')));
}

TEST(JsonBounds, TooHeavyIsRefusedBeforeTheDocumentIsBuilt) {
  JsonBounds b;
  b.max_weight = 1000;
  // 250 empty objects weigh 4 each plus the array: over 1000; 240 are not.
  auto objects = parse_bounded<json>(repeated("{}", 250), b);
  ASSERT_FALSE(objects);
  EXPECT_NE(objects.status().message().find("too many values (more than 1000"), std::string::npos)
      << objects.status().message();
  EXPECT_TRUE(parse_bounded<json>(repeated("{}", 240), b));
  EXPECT_FALSE(parse_bounded<json>(repeated("1", 1000), b));
  EXPECT_TRUE(parse_bounded<json>(repeated("1", 990), b));
  // A long string weighs its length.
  EXPECT_FALSE(parse_bounded<json>(repeated("\"" + std::string(16 * 1000, 'a') + "\"", 1), b));
  // The default bound: 5M empty objects in 16 MiB, which would build about 650 MB, are not
  // built.
  auto hostile = parse_bounded<json>(repeated("{}", 5'000'000));
  ASSERT_FALSE(hostile);
  EXPECT_NE(hostile.status().message().find("too many values"), std::string::npos);
}

TEST(JsonBounds, TextThatIsNotJsonIsRefusedAsSuch) {
  for (const char* text : {"", "{", "{\"a\": 1} x", "[1,]", "nul"}) {
    auto j = parse_bounded<json>(text);
    ASSERT_FALSE(j) << text;
    EXPECT_EQ(j.status().message(), "the body is not JSON") << text;
  }
}

}  // namespace
}  // namespace rd2h::http
