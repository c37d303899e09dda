// The `deltastate` subcommands. Each takes the arguments after its name and returns the process
// exit code; bad arguments throw UsageError, library failures deltastate::Error.
#pragma once

#include <string>
#include <vector>

namespace deltastate::cli {

int run_demo(const std::vector<std::string>& args);
int run_bench(const std::vector<std::string>& args);

}  // namespace deltastate::cli
