#include "cli_args.h"

#include <algorithm>
#include <charconv>

namespace deltastate::cli {

namespace {

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    parts.push_back(text.substr(start, comma - start));
    if (comma == std::string::npos) return parts;
    start = comma + 1;
  }
}

int64_t parse_int(const std::string& flag, const std::string& text, int64_t lo, int64_t hi) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ptr != end || ec == std::errc::invalid_argument)
    throw UsageError(flag + ": expected an integer, got '" + text + "'");
  if (ec == std::errc::result_out_of_range || value < lo || value > hi)
    throw UsageError(flag + ": " + text + " is out of range [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
  return value;
}

const std::string& parse_choice(const std::string& flag, const std::string& text,
                                const std::vector<std::string>& choices) {
  const auto it = std::find(choices.begin(), choices.end(), text);
  if (it == choices.end())
    throw UsageError(flag + ": unknown value '" + text + "' (choose from " + join(choices, ", ") +
                     ")");
  return *it;
}

std::string int_list_text(const std::vector<int64_t>& values) {
  std::vector<std::string> parts;
  for (int64_t v : values) parts.push_back(std::to_string(v));
  return join(parts, ",");
}

}  // namespace

ArgParser::ArgParser(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

void ArgParser::add(std::string name, std::string metavar, std::string help,
                    std::string default_text, std::function<void(const std::string&)> set) {
  options_.push_back({std::move(name), std::move(metavar), std::move(help), std::move(default_text),
                      std::move(set)});
}

void ArgParser::add_int(const char* name, int64_t* value, int64_t lo, int64_t hi,
                        const char* help) {
  const std::string flag = std::string("--") + name;
  add(name, "N", help, std::to_string(*value),
      [=](const std::string& text) { *value = parse_int(flag, text, lo, hi); });
}

void ArgParser::add_int_list(const char* name, std::vector<int64_t>* values, int64_t lo, int64_t hi,
                             const char* help) {
  const std::string flag = std::string("--") + name;
  add(name, "N[,N...]", help, int_list_text(*values), [=](const std::string& text) {
    values->clear();
    for (const std::string& part : split_commas(text))
      values->push_back(parse_int(flag, part, lo, hi));
  });
}

void ArgParser::add_choice(const char* name, std::string* value, std::vector<std::string> choices,
                           const char* help) {
  const std::string flag = std::string("--") + name;
  add(name, join(choices, "|"), help, *value,
      [=](const std::string& text) { *value = parse_choice(flag, text, choices); });
}

void ArgParser::add_string(const char* name, std::string* value, const char* help) {
  add(name, "TEXT", help, value->empty() ? "none" : *value,
      [=](const std::string& text) { *value = text; });
}

void ArgParser::add_choice_list(const char* name, std::vector<std::string>* values,
                                std::vector<std::string> choices, const char* help) {
  const std::string flag = std::string("--") + name;
  const std::string default_text = *values == choices ? "all" : join(*values, ",");
  add(name, "OP[,OP...]|all", help + std::string(": ") + join(choices, ", "), default_text,
      [=](const std::string& text) {
        if (text == "all") {
          *values = choices;
          return;
        }
        values->clear();
        for (const std::string& part : split_commas(text))
          values->push_back(parse_choice(flag, part, choices));
      });
}

bool ArgParser::parse(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h") {
      print_help(stdout);
      return false;
    }
    if (arg.rfind("--", 0) != 0) throw UsageError(command_ + ": unexpected argument '" + arg + "'");
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const auto option = std::find_if(options_.begin(), options_.end(),
                                     [&](const Option& o) { return o.name == name; });
    if (option == options_.end()) throw UsageError(command_ + ": unknown option '--" + name + "'");
    if (eq != std::string::npos) {
      option->set(arg.substr(eq + 1));
    } else if (i + 1 < args.size()) {
      option->set(args[++i]);
    } else {
      throw UsageError("--" + name + ": missing value");
    }
  }
  return true;
}

void ArgParser::print_help(std::FILE* to) const {
  std::fprintf(to, "usage: deltastate %s [options]\n\n%s\n\noptions:\n", command_.c_str(),
               summary_.c_str());
  constexpr int kColumn = 28;  // longer option names get their help on the next line
  for (const Option& o : options_) {
    const std::string left = "--" + o.name + " " + o.metavar;
    if (left.size() > kColumn) std::fprintf(to, "  %s\n  %-*s", left.c_str(), kColumn, "");
    else std::fprintf(to, "  %-*s", kColumn, left.c_str());
    std::fprintf(to, " %s (default: %s)\n", o.help.c_str(), o.default_text.c_str());
  }
  std::fprintf(to, "  %-*s show this help\n", kColumn, "-h, --help");
}

}  // namespace deltastate::cli
