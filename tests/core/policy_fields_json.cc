// Prints the policy's field declaration (kvcomp/core/policy_fields.def) as JSON, for
// scripts/check_policy_fields.py and tests/python/test_policy_fields.py.
#include <cstdio>

#include "kvcomp/core/policy_fields.h"

int main() {
  std::fputs(kvcomp::PolicyFieldsJson().c_str(), stdout);
  return 0;
}
