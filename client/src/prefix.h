// Fan-out of prefix requests: chunk i of a run lives where its own key ranks (rendezvous), so a
// run's keys are grouped by endpoint and every endpoint involved is asked once, in parallel, for
// the leading keys of its group it holds. The run's answer is the first position some endpoint
// reports missing. An endpoint that fails with a retryable error is replaced, for each of its
// positions, by the next endpoint of that position's ranking.
#ifndef KVCOMP_CLIENT_SRC_PREFIX_H_
#define KVCOMP_CLIENT_SRC_PREFIX_H_

#include <cstddef>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"

namespace kvcomp {
namespace client {

// `rankings[p]` lists the endpoints (indexes) that may hold position p, best first.
// `ask(endpoint, positions)` returns how many leading `positions` (ascending) that endpoint
// holds; it is called from several threads at once (once per endpoint per round). Returns the
// number of leading positions held over all endpoints; a position whose every endpoint failed
// with a retryable error (Unavailable, DeadlineExceeded) counts as missing, as long as some
// endpoint answered at all: when none did, the last such error is returned ("no endpoint
// answered: ..."), not a miss. Other errors are returned as they are.
absl::StatusOr<size_t> LeadingHeld(
    const std::vector<std::vector<size_t>>& rankings,
    absl::FunctionRef<absl::StatusOr<size_t>(size_t endpoint, const std::vector<size_t>& positions)>
        ask);

}  // namespace client
}  // namespace kvcomp

#endif  // KVCOMP_CLIENT_SRC_PREFIX_H_
