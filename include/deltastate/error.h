// deltastate: the one exception type every public call throws.
#pragma once

#include <stdexcept>
#include <string>

namespace deltastate {

// What kind of misuse (or failure) an Error reports. Bindings map these to their language's
// exception classes (Python: value -> ValueError, type -> TypeError, ...).
enum class ErrorKind {
  value,            // a contract violation: shape, stride, dtype, device, index, argument value
  type,             // wrong kind of argument (bindings only)
  not_implemented,  // a backend lacks a feature (e.g. built without CUDA)
  runtime,          // a failure while running (CUDA error, allocation failure)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

// Shorthand for the common case: a contract violation.
[[noreturn]] inline void throw_value_error(const std::string& message) {
  throw Error(ErrorKind::value, message);
}

}  // namespace deltastate
