#include "prefix.h"

#include <algorithm>
#include <map>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "endpoint_state.h"

namespace kvcomp {
namespace client {

absl::StatusOr<size_t> LeadingHeld(
    const std::vector<std::vector<size_t>>& rankings,
    absl::FunctionRef<absl::StatusOr<size_t>(size_t endpoint, const std::vector<size_t>& positions)>
        ask) {
  const size_t n = rankings.size();
  size_t bound = n;                     // first position known missing (or n)
  std::vector<size_t> attempt(n, 0);    // index into rankings[p] of the endpoint to ask next
  std::vector<size_t> pending(n);
  bool answered = false;     // some endpoint answered (for some positions)
  absl::Status unanswered;   // the last retryable failure

  for (size_t p = 0; p < n; ++p) pending[p] = p;
  while (!pending.empty()) {
    std::map<size_t, std::vector<size_t>> groups;  // endpoint -> ascending positions
    for (size_t p : pending) {
      if (p >= bound) break;
      if (attempt[p] >= rankings[p].size()) {
        bound = p;  // no endpoint left to ask: missing
        break;
      }
      groups[rankings[p][attempt[p]]].push_back(p);
    }
    std::vector<std::pair<size_t, std::vector<size_t>>> work(groups.begin(), groups.end());
    std::vector<absl::StatusOr<size_t>> answers(work.size(), absl::UnknownError("not asked"));
    if (work.size() == 1) {
      answers[0] = ask(work[0].first, work[0].second);
    } else {
      std::vector<std::thread> threads;
      threads.reserve(work.size());
      for (size_t g = 0; g < work.size(); ++g) {
        threads.emplace_back([&, g] { answers[g] = ask(work[g].first, work[g].second); });
      }
      for (std::thread& t : threads) t.join();
    }
    std::vector<size_t> again;
    for (size_t g = 0; g < work.size(); ++g) {
      const std::vector<size_t>& positions = work[g].second;
      if (answers[g].ok()) {
        answered = true;
        const size_t held = std::min(*answers[g], positions.size());
        if (held < positions.size()) bound = std::min(bound, positions[held]);
        continue;
      }
      if (!Retryable(answers[g].status())) return answers[g].status();
      unanswered = answers[g].status();
      for (size_t p : positions) {
        ++attempt[p];
        again.push_back(p);
      }
    }
    std::sort(again.begin(), again.end());
    pending = std::move(again);
  }
  if (!answered && !unanswered.ok()) {
    // Not one endpoint answered: a miss would be a guess (wrong address, pool down).
    return absl::Status(unanswered.code(),
                        absl::StrCat("no endpoint answered: ", unanswered.message()));
  }
  return bound;
}

}  // namespace client
}  // namespace kvcomp
