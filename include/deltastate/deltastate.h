// deltastate: the whole public C++ API.
#pragma once

#include "deltastate/error.h"
#include "deltastate/ops.h"
#include "deltastate/state_pool.h"
#include "deltastate/stream.h"
#include "deltastate/tensor.h"
