// The channel between the engine loop and an HTTP call keeps only the newest output of each
// choice, so a waiting thread that missed steps loses nothing: outputs are cumulative, and the
// route rows of a streamed request (deltas, one per output) are joined until taken.
#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <vector>

#include "serving/channel.h"

namespace r3::serving {
namespace {

RequestOutput partial(std::vector<int> tokens, int first_row, int rows, bool finished = false) {
  RequestOutput o;
  o.token_ids = std::move(tokens);
  o.finished = finished;
  RouteArray r(rows, 2, 3, int16_t(0));
  r.start = first_row;
  for (size_t i = 0; i < r.data.size(); ++i) r.data[i] = int16_t(first_row * 100 + int(i));
  o.routed_experts = std::move(r);
  return o;
}

TEST(Channel, StreamedRouteRowsOfUntakenOutputsAreJoined) {
  Channel ch(1, true);
  ch.publish(0, partial({1}, 4, 3));     // the prompt's rows 4..6 with the first token
  ch.publish(0, partial({1, 2}, 7, 1));  // row 7 with the second
  ch.publish(0, partial({1, 2, 3}, 8, 1));
  uint64_t seen = 0;
  std::vector<std::optional<RequestOutput>> out;
  ASSERT_TRUE(ch.take(seen, std::chrono::milliseconds(0), out));
  ASSERT_TRUE(out[0] && out[0]->routed_experts);
  const RouteArray& r = *out[0]->routed_experts;
  EXPECT_EQ(out[0]->token_ids, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(r.start, 4);
  ASSERT_EQ(r.rows, 5);
  std::vector<int16_t> expected;
  for (auto [first, rows] : {std::pair{4, 3}, {7, 1}, {8, 1}})
    for (int i = 0; i < rows * 6; ++i) expected.push_back(int16_t(first * 100 + i));
  EXPECT_EQ(r.data, expected);
  // Taken: the next output starts afresh; a finished one carries every row itself.
  ch.publish(0, partial({1, 2, 3, 4}, 9, 1));
  ch.publish(0, partial({1, 2, 3, 4, 5}, 4, 6, true));
  ASSERT_TRUE(ch.take(seen, std::chrono::milliseconds(0), out));
  EXPECT_EQ(out[0]->routed_experts->start, 4);
  EXPECT_EQ(out[0]->routed_experts->rows, 6);
}

}  // namespace
}  // namespace r3::serving
