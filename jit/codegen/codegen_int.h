/* SPDX-License-Identifier: MIT */
/*
 * codegen_int.h - the only header of gradjit that names LLVM types. Included by
 * lower.c (plan -> LLVM IR) and llvmjit.c (target, LLJIT, bitcode, passes);
 * everything outside these two files sees codegen.h, which has no LLVM type.
 */
#ifndef GJ_JIT_LLVM_INT_H
#define GJ_JIT_LLVM_INT_H

#include "jit/plan/plan.h"

#include <llvm-c/Core.h>

/* Emits one function per distinct kernel of p into module M (whose bitcode
 * math, gj_bc_*, is already linked in): `<prefix>_<kernel name>` with the
 * gj_jit_kernel calling convention (see plan.h). cpu/features become the
 * functions' target attributes. With shard_of_instr != NULL, only the
 * kernels whose first instruction s has shard_of_instr[s] == shard (the modules of
 * a parallel compile, llvmjit.c). Returns 0, or -1 with why[] set. */
int gj_jit_lower_plan(LLVMModuleRef M, const gj_jit_plan *p, const char *prefix,
                      const char *cpu, const char *features, const int *shard_of_instr,
                      int shard, char *why, size_t why_cap);

#endif /* GJ_JIT_LLVM_INT_H */
