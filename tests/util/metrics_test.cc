// The Prometheus text format as GET /metrics writes it.
#include "util/metrics.h"

#include <gtest/gtest.h>

namespace rd2h::metrics {
namespace {

TEST(Metrics, CountersAndGaugesRenderWithHelpTypeAndEscapedLabels) {
  Registry r;
  auto& requests = r.counter("x_requests_total", "Requests answered", {"route", "status"});
  requests.with({"/v1/completions", "200"}).inc(3);
  requests.with({"a\"b\\c\nd", "500"}).inc();
  r.gauge("x_in_flight", "In flight").with().add(2);
  r.gauge_callback("x_free", "Free", [] { return 7.5; });
  r.counter_callback("x_posts_total", "Posts", [] { return 4.0; });
  EXPECT_EQ(r.render(),
            "# HELP x_requests_total Requests answered\n"
            "# TYPE x_requests_total counter\n"
            "x_requests_total{route=\"/v1/completions\",status=\"200\"} 3\n"
            "x_requests_total{route=\"a\\\"b\\\\c\\nd\",status=\"500\"} 1\n"
            "# HELP x_in_flight In flight\n"
            "# TYPE x_in_flight gauge\n"
            "x_in_flight 2\n"
            "# HELP x_free Free\n"
            "# TYPE x_free gauge\n"
            "x_free 7.5\n"
            "# HELP x_posts_total Posts\n"
            "# TYPE x_posts_total counter\n"
            "x_posts_total 4\n");
}

TEST(Metrics, AHistogramsBucketsAreCumulativeUpToInf) {
  Registry r;
  auto& h = r.histogram("x_seconds", "Latency", {"route"}, {0.1, 1});
  auto& s = h.with({"/a"});
  s.observe(0.05);
  s.observe(0.1);  // a bound counts in its own bucket
  s.observe(0.5);
  s.observe(3);
  s.add({1, 0, 2}, 10.0);  // counts kept elsewhere
  EXPECT_EQ(r.render(),
            "# HELP x_seconds Latency\n"
            "# TYPE x_seconds histogram\n"
            "x_seconds_bucket{route=\"/a\",le=\"0.1\"} 3\n"
            "x_seconds_bucket{route=\"/a\",le=\"1\"} 4\n"
            "x_seconds_bucket{route=\"/a\",le=\"+Inf\"} 7\n"
            "x_seconds_sum{route=\"/a\"} 13.65\n"
            "x_seconds_count{route=\"/a\"} 7\n");
}

TEST(Metrics, QuantileIsTheNearestRank) {
  EXPECT_EQ(quantile({}, 0.5), 0);
  EXPECT_EQ(quantile({5}, 0.99), 5);
  EXPECT_EQ(quantile({4, 1, 3, 2}, 0.5), 2);
  std::vector<double> hundred;
  for (int i = 100; i >= 1; --i) hundred.push_back(i);
  EXPECT_EQ(quantile(hundred, 0.99), 99);
  EXPECT_EQ(quantile(hundred, 1.0), 100);
}

}  // namespace
}  // namespace rd2h::metrics
