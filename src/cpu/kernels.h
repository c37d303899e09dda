// The CPU backend: one entry point per op, each running a validated problem on the thread pool.
#pragma once

#include "core/problem.h"

namespace deltastate::cpu {

void run_recurrent(const detail::RecurrentProblem& p);       // recurrent.cpp (packed decode too)
void run_replayssm_decode(const detail::ReplayProblem& p);   // replayssm_decode.cpp

}  // namespace deltastate::cpu
