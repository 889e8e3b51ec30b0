// kvq: umbrella header — quantized KV cache codecs, cache and decode attention.
#pragma once

#include "any_cache.hpp"
#include "attention.hpp"
#include "backend/backend.hpp"
#include "cache.hpp"
#include "codec/codec.hpp"
#include "codec/fp4.hpp"
#include "codec/fp8.hpp"
#include "codec/int8.hpp"
#include "codec/kivi.hpp"
#include "codec/passthrough.hpp"
#include "codec/q4_0.hpp"
#include "codec/q8_0.hpp"
#include "error.hpp"
#include "simd.hpp"
#include "version.hpp"
