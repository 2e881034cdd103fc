// kvcompd: parses the command line (kvcomp/service/config.h), starts the daemon and turns
// signals into lifecycle steps: SIGTERM/SIGINT drain and stop, SIGHUP reloads the tokens. An
// engine failure (a sticky GPU error) drains and exits with status 4.
#include <signal.h>

#include <cstdio>
#include <iostream>
#include <string>

#include "absl/time/clock.h"
#include "kvcomp/service/config.h"
#include "kvcomp/service/daemon.h"

int main(int argc, char** argv) {
  using kvcomp::service::CommandLine;
  std::string text;
  CommandLine cl = kvcomp::service::ParseCommandLine(argc, argv, &text);
  if (cl.exit_now) {
    (cl.exit_code == 0 ? std::cout : std::cerr) << text;
    return cl.exit_code;
  }
  if (cl.print_config) {
    std::cout << kvcomp::service::OptionsToYaml(cl.options);
    return 0;
  }
  // Every thread the daemon starts inherits this mask; signals are taken by sigtimedwait below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto daemon = kvcomp::service::Daemon::Start(cl.options);
  if (!daemon.ok()) {
    std::cerr << "kvcompd: cannot start: " << daemon.status().ToString() << "\n";
    return 1;
  }
  while (true) {
    timespec timeout{1, 0};
    int sig = sigtimedwait(&signals, nullptr, &timeout);
    if (sig == SIGHUP) {
      (void)(*daemon)->ReloadTokens();
    } else if (sig == SIGTERM || sig == SIGINT) {
      break;
    }
    (*daemon)->Tick();
    if ((*daemon)->failed()) break;  // Tick has started the drain
  }
  const bool failed = (*daemon)->failed();
  absl::Status s = (*daemon)->Shutdown(absl::Seconds(cl.options.process.shutdown_grace_seconds));
  daemon->reset();
  if (failed) {
    std::cerr << "kvcompd: exiting after an engine failure (exit status 4)\n";
    return 4;
  }
  return s.ok() ? 0 : 3;
}
