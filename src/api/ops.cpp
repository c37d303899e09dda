// Public op entry points: validate (src/contracts), then run on the tensors' device.
#include "deltastate/ops.h"

#include "api/backend.h"
#include "contracts/validate.h"
#include "cpu/kernels.h"

namespace deltastate {

namespace {

void run(const detail::RecurrentProblem& p, Stream stream) {
  if (p.N == 0) return;
  if (p.device.type == DeviceType::cpu) cpu::run_recurrent(p);
  else cuda_backend::run_recurrent(p, stream);
}

}  // namespace

void gdn_packed_decode(const PackedDecodeArgs& args) {
  run(detail::validate_packed_decode(args, /*kda=*/false), args.stream);
}

void kda_packed_decode(const PackedDecodeArgs& args) {
  run(detail::validate_packed_decode(args, /*kda=*/true), args.stream);
}

void recurrent_gdn(const RecurrentArgs& args) {
  run(detail::validate_recurrent(args, /*kda=*/false), args.stream);
}

void recurrent_kda(const RecurrentArgs& args) {
  run(detail::validate_recurrent(args, /*kda=*/true), args.stream);
}

void replayssm_decode(const ReplayDecodeArgs& args) {
  const detail::ReplayProblem p = detail::validate_replayssm_decode(args);
  if (p.B == 0) return;
  if (p.device.type == DeviceType::cpu) cpu::run_replayssm_decode(p);
  else cuda_backend::run_replayssm_decode(p, args.stream);
}

bool cuda_available() { return cuda_backend::device_available(); }
bool cuda_built() { return cuda_backend::built(); }

}  // namespace deltastate
