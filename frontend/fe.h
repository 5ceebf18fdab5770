/* SPDX-License-Identifier: MIT */
/*
 * fe.h - internal helpers shared by the frontend files (not installed).
 */
#ifndef GJ_FE_H
#define GJ_FE_H

#include "../autograd/ag.h"

/* Hands a new reference t to the innermost open scope (if any) and returns
 * t; NULL passes through. Every public function returning a tensor ends
 * with it. */
gj_tensor *gj_fe_own(gj_tensor *t);

/* The compiled-autograd flag as seen by gj_backward/gj_grad (reads
 * GRADJIT_COMPILED_AUTOGRAD once). */
bool gj_fe_compiled_enabled(void);
void gj_fe_count_backward(void);

/* Appended by helper "hooks": gj_scope_push that returns the identity of
 * the scope it opened (see gj_ag_set_user_scope). */
void *gj_fe_user_scope_push(void);

#endif /* GJ_FE_H */
