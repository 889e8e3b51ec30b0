// kvq: the library version. CMake checks at configure time that it equals project(VERSION).
#pragma once

#define KVQ_VERSION_MAJOR 0
#define KVQ_VERSION_MINOR 1
#define KVQ_VERSION_PATCH 0

/// The version as one number, MAJOR * 10000 + MINOR * 100 + PATCH (0.1.0 is 100).
#define KVQ_VERSION (KVQ_VERSION_MAJOR * 10000 + KVQ_VERSION_MINOR * 100 + KVQ_VERSION_PATCH)
