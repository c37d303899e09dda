// deltastate: command-line front end of the library. Dispatches to a subcommand and turns every
// failure into one line on stderr and a nonzero exit code:
//   0 success, 1 the demo's two paths disagree, 2 bad command line, 3 library or runtime error.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cli_args.h"
#include "commands.h"
#include "deltastate/deltastate.h"

namespace {

constexpr int kExitUsage = 2;
constexpr int kExitFailure = 3;

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>&);
};

const Command kCommands[] = {
    {"demo", "continuous-batching simulation: packed decode vs ReplaySSM, checked to agree",
     deltastate::cli::run_demo},
    {"bench", "CPU throughput of every decode op (time, bytes moved, GB/s)",
     deltastate::cli::run_bench},
};

void print_usage() {
  std::printf("usage: deltastate <command> [options]\n\ncommands:\n");
  for (const Command& c : kCommands) std::printf("  %-8s %s\n", c.name, c.summary);
  std::printf(
      "\nRun 'deltastate <command> --help' for a command's options, 'deltastate --version'\n"
      "for the version and whether this build has the CUDA backend.\n");
}

const char* kind_name(deltastate::ErrorKind kind) {
  switch (kind) {
    case deltastate::ErrorKind::value:
      return "value error";
    case deltastate::ErrorKind::type:
      return "type error";
    case deltastate::ErrorKind::not_implemented:
      return "not implemented";
    case deltastate::ErrorKind::runtime:
      return "runtime error";
  }
  return "error";
}

// Prints "deltastate: <what>: <message>" as exactly one line.
void print_error(const std::string& what, std::string message) {
  std::replace(message.begin(), message.end(), '\n', ' ');
  std::fflush(stdout);
  std::fprintf(stderr, "deltastate: %s: %s\n", what.c_str(), message.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    print_error("error", "no command given (try 'deltastate --help')");
    return kExitUsage;
  }
  if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    print_usage();
    return 0;
  }
  if (args[0] == "--version" || args[0] == "-V") {
    std::printf("deltastate %s (CUDA backend: %s)\n", DELTASTATE_VERSION,
                deltastate::cuda_built() ? "built" : "not built");
    return 0;
  }
  const auto command = std::find_if(std::begin(kCommands), std::end(kCommands),
                                    [&](const Command& c) { return args[0] == c.name; });
  if (command == std::end(kCommands)) {
    print_error("error", "unknown command '" + args[0] + "' (try 'deltastate --help')");
    return kExitUsage;
  }
  try {
    return command->run(std::vector<std::string>(args.begin() + 1, args.end()));
  } catch (const deltastate::cli::UsageError& e) {
    print_error("error",
                std::string(e.what()) + " (try 'deltastate " + command->name + " --help')");
    return kExitUsage;
  } catch (const deltastate::Error& e) {
    print_error(kind_name(e.kind()), e.what());
  } catch (const std::exception& e) {
    print_error("error", e.what());
  } catch (...) {
    print_error("error", "unknown exception");
  }
  return kExitFailure;
}
