// libFuzzer target for the configuration parser (ApplyYaml, then ValidateOptions). Any input gets
// a status, never a crash. A document it accepts prints back (OptionsToYaml) as YAML that parses
// to the same options: printing it again gives the same text.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kvcomp/service/config.h"
#include "kvcomp/service/options.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  kvcomp::service::Options options;
  if (!kvcomp::service::ApplyYaml(options, text).ok()) return 0;
  (void)kvcomp::service::ValidateOptions(options);
  const std::string printed = kvcomp::service::OptionsToYaml(options);
  kvcomp::service::Options again;
  if (!kvcomp::service::ApplyYaml(again, printed).ok()) std::abort();
  if (kvcomp::service::OptionsToYaml(again) != printed) std::abort();
  return 0;
}
