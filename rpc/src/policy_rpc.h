// The control plane's Policy struct (service/thrift/kvcomp.thrift) and CompressionPolicy, field
// by field as kvcomp/core/policy_fields.def declares them: enums by name, booleans and doubles as
// themselves, integers as i64. Used by the control-plane handlers (SetPolicy, GetPolicy).
// Also the Status struct and absl::Status, both ways, for the daemon's handlers and the SDK.
#ifndef KVCOMP_RPC_SRC_POLICY_RPC_H_
#define KVCOMP_RPC_SRC_POLICY_RPC_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvcomp/core/policy.h"
#include "kvcomp/rpc/kvcomp_types.h"

namespace kvcomp {
namespace service {

// Every field of `policy`; a seed above 2^63 - 1 reads back negative (Thrift has no u64).
rpc::Policy PolicyToRpc(const CompressionPolicy& policy);

// A validated policy, or InvalidArgument naming the first field that is not: an unknown enum
// name, an integer outside its type (a negative count, a count above 2^32 - 1), a value outside
// the field's declared range, or a rule between fields (CompressionPolicy::Validate).
absl::StatusOr<CompressionPolicy> PolicyFromRpc(const rpc::Policy& policy);

// A status as the control plane carries it: code, message and the typed detail
// (kvcomp::ErrorDetail, Status.detail), so that a caller decides on the detail, not the text.
rpc::Status StatusToRpc(const absl::Status& status);
// The other way; an unknown code reads as kUnknown, an unknown detail as none.
absl::Status StatusFromRpc(const rpc::Status& status);

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_RPC_SRC_POLICY_RPC_H_
