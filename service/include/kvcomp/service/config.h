// The one place where YAML keys, command-line flags and environment variables map onto Options.
//
// Every field of Options is one row of ConfigFields(): its YAML key (a dotted path, e.g.
// `data_plane.port`), the flag `--data_plane.port`, the environment variable
// `KVCOMP_DATA_PLANE_PORT` (KVCOMP_ + the key upper-cased with '.' as '_'), its type and help.
// Layers apply in order: embedded defaults, the YAML file (--config or KVCOMP_CONFIG), the
// environment, flags. Unknown YAML keys and malformed values are InvalidArgument naming the key.
// Thread-compatible: plain functions over values.
#ifndef KVCOMP_SERVICE_CONFIG_H_
#define KVCOMP_SERVICE_CONFIG_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcomp/service/options.h"

namespace kvcomp {
namespace service {

struct ConfigField {
  std::string key;   // YAML path, "data_plane.port"
  std::string type;  // "string", "bool", "int", "uint", "bytes", "seconds", "fraction", "enum"
  std::string help;  // one line, with the unit and default
  std::function<absl::Status(Options&, absl::string_view)> set;  // parses and assigns
  std::function<std::string(const Options&)> get;                // current value as text

  std::string flag() const;     // "--" + key
  std::string env_var() const;  // "KVCOMP_" + upper(key with '.' -> '_')
};

// Every option, in documentation order.
const std::vector<ConfigField>& ConfigFields();

// Sets the field named by its YAML key from text. NotFound for an unknown key.
absl::Status SetOption(Options& options, absl::string_view key, absl::string_view value);

// Applies a YAML document (nested maps; scalars as values). Unknown keys are errors.
absl::Status ApplyYaml(Options& options, absl::string_view yaml_text);
absl::Status ApplyYamlFile(Options& options, const std::string& path);
// Applies every KVCOMP_* variable of the process environment that names a field.
absl::Status ApplyEnvironment(Options& options);

// Cross-field checks (ports, watermarks, TLS files, enum values). InvalidArgument on the first.
absl::Status ValidateOptions(const Options& options);

// The CUDA devices of engine.cuda_devices (ordinals, in the order given), or {cuda_device}
// when it is empty. InvalidArgument for text that is not a list of distinct ordinals in
// [0, 64].
absl::StatusOr<std::vector<int>> EngineCudaDevices(const EngineOptions& engine);

// The effective configuration as YAML (every key, nested), loadable by ApplyYaml.
std::string OptionsToYaml(const Options& options);

// What the command line asked for.
struct CommandLine {
  Options options;
  bool print_config = false;  // --print-config: dump the effective YAML and exit
  bool exit_now = false;      // --help was printed (exit_code 0) or parsing failed
  int exit_code = 0;
  std::string config_file;  // --config / KVCOMP_CONFIG
};

// Parses argv with CLI11 (every field is a flag; --help lists them all with their defaults and
// environment variables), then layers defaults, YAML, environment and flags as above.
// `out` receives --help text and parse errors.
CommandLine ParseCommandLine(int argc, char** argv, std::string* out);

}  // namespace service
}  // namespace kvcomp

#endif  // KVCOMP_SERVICE_CONFIG_H_
