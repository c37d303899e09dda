// A tiny command-line parser shared by the `deltastate` subcommands: `--name value` or
// `--name=value` options, each bound to a variable whose initial value is the default shown by
// --help. Every malformed input throws UsageError with a one-line message.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace deltastate::cli {

// A bad command line: printed as one line, exit code 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ArgParser {
 public:
  // `command` is the subcommand name ("demo"), `summary` one line describing it.
  ArgParser(std::string command, std::string summary);

  // An integer in [lo, hi].
  void add_int(const char* name, int64_t* value, int64_t lo, int64_t hi, const char* help);
  // A comma-separated list of integers, each in [lo, hi].
  void add_int_list(const char* name, std::vector<int64_t>* values, int64_t lo, int64_t hi,
                    const char* help);
  // One of `choices`.
  void add_choice(const char* name, std::string* value, std::vector<std::string> choices,
                  const char* help);
  // A comma-separated list of `choices`; "all" selects every choice.
  void add_choice_list(const char* name, std::vector<std::string>* values,
                       std::vector<std::string> choices, const char* help);

  // Any text (a path).
  void add_string(const char* name, std::string* value, const char* help);

  // Parses args (everything after the subcommand). Returns false when --help was given (the help
  // has been printed to stdout); throws UsageError for anything malformed.
  bool parse(const std::vector<std::string>& args);
  void print_help(std::FILE* to) const;

 private:
  struct Option {
    std::string name, metavar, help, default_text;
    std::function<void(const std::string&)> set;
  };
  void add(std::string name, std::string metavar, std::string help, std::string default_text,
           std::function<void(const std::string&)> set);

  std::string command_, summary_;
  std::vector<Option> options_;
};

}  // namespace deltastate::cli
