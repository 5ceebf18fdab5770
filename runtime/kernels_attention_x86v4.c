/* SPDX-License-Identifier: MIT */
/*
 * kernels_attention_x86v4.c - the eager attention kernel's units built for
 * x86-64-v4 (the build compiles this file with -march=x86-64-v4; the
 * kernel calls it only on a CPU that runs it). See attention_units.h.
 */
#define GJ_ATTN_ISA x86v4
#include "runtime/attention_units.h"
