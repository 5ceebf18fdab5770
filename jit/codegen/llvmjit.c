/* SPDX-License-Identifier: MIT */
/*
 * llvmjit.c - LLVM target setup, the process-wide ORC LLJIT, bitcode math
 * linking, the optimisation pipeline and symbol lookup.
 *
 * Invariants:
 *   - The native target is initialised once; the LLJIT (host CPU name and
 *     features) is created on first use and lives until
 *     gj_jit_llvm_shutdown. A global mutex serialises every use of it
 *     (compiling is rare; running compiled code takes no lock).
 *   - A plan's distinct kernels go into up to one module per thread (at
 *     most GJ_JIT_MAX_SHARDS), each lowered, optimised and compiled to an
 *     object file in its own LLVM context with its own target machine on
 *     its own thread, while the caller holds the mutex. The object files
 *     are added to the LLJIT's object layer under one resource tracker per
 *     plan (freeing a program frees its machine code, and the symbol names
 *     no longer used leave ORC's string pool). The same object bytes (one
 *     object, or several behind a "GJMO" header) are what the disk cache
 *     stores and loads.
 *   - Every LLVMErrorRef is consumed: turned into text in why[] (and the
 *     caller falls back to eager). LLVM never aborts the process on our
 *     behalf: the module is verified before optimisation, and JIT session
 *     errors go to our reporter instead of stderr.
 *   - Process symbols (libm's powf/pow from the math bitcode) resolve through
 *     a dynamic-library search generator on the main JITDylib.
 */
#include "jit/base/base.h"
#include "jit/codegen/codegen.h"
#include "jit/codegen/codegen_int.h"

#include <llvm-c/Analysis.h>
#include <llvm-c/BitReader.h>
#include <llvm-c/Error.h>
#include <llvm-c/LLJIT.h>
#include <llvm-c/Linker.h>
#include <llvm-c/Orc.h>
#include <llvm-c/Target.h>
#include <llvm-c/TargetMachine.h>
#include <llvm-c/Transforms/PassBuilder.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

extern const unsigned char gj_rt_math_bc[];
extern const size_t gj_rt_math_bc_size;
extern const unsigned char gj_rt_attn_bc[];
extern const size_t gj_rt_attn_bc_size;

struct gj_jit_code {
    atomic_int refs;  /* gj_jit_code_ref; the last gj_jit_code_free frees */
    LLVMOrcResourceTrackerRef rt;
    size_t obj_bytes; /* size of the object code it was loaded from */
    int parts;        /* object files in it */
    char prefix[GJ_JIT_PREFIX_MAX]; /* its symbols' prefix: unique among live codes */
    unsigned char *obj; /* a copy of its object code (kept on request), or NULL */
    gj_jit_code *live_next, *live_prev; /* g.live: every code object, under g_lock */
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

#define GJ_JIT_MAX_SHARDS 4 /* modules of one parallel compile, at most */
static const char GJ_MULTI_MAGIC[4] = {'G', 'J', 'M', 'O'}; /* several objects in one */

static double cpu_ms_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}
static struct {
    bool target_ready;
    LLVMOrcLLJITRef jit;
    char *cpu, *features;    /* LLVMDisposeMessage */
    char *triple, *layout;   /* gj_rt_malloc'd copies */
    uint64_t next_id;
    char session_error[512]; /* last message of the session error reporter */
    gj_jit_code *live;       /* every live code object (their prefixes are distinct) */
} g;
/* Consumes err into why ("LLVM error (what): message"). */
static void take_error(LLVMErrorRef err, const char *what, char *why, size_t cap) {
    char *msg = LLVMGetErrorMessage(err);
    snprintf(why, cap, "LLVM error (%s): %s", what, msg ? msg : "?");
    LLVMDisposeErrorMessage(msg);
}

static void session_reporter(void *ctx, LLVMErrorRef err) {
    (void)ctx;
    take_error(err, "session", g.session_error, sizeof g.session_error);
}

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = gj_rt_malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* Creates the LLJIT and target machine if needed (lock held). */
static int ensure_jit(char *why, size_t cap) {
    if (g.jit) return 0;
    if (!g.target_ready) {
        if (LLVMInitializeNativeTarget() != 0 || LLVMInitializeNativeAsmPrinter() != 0) {
            snprintf(why, cap, "LLVM error: no native target");
            return -1;
        }
        g.target_ready = true;
    }
    char *triple = LLVMGetDefaultTargetTriple();
    char *err_msg = NULL;
    LLVMTargetRef target;
    LLVMTargetMachineRef tm_jit = NULL;
    LLVMOrcLLJITBuilderRef builder = NULL;
    LLVMOrcLLJITRef jit = NULL;
    if (LLVMGetTargetFromTriple(triple, &target, &err_msg) != 0) {
        snprintf(why, cap, "LLVM error (target %s): %s", triple, err_msg ? err_msg : "?");
        LLVMDisposeMessage(err_msg);
        goto fail;
    }
    if (!g.cpu) g.cpu = LLVMGetHostCPUName();
    if (!g.features) g.features = LLVMGetHostCPUFeatures();
    tm_jit = LLVMCreateTargetMachine(target, triple, g.cpu, g.features,
                                     LLVMCodeGenLevelAggressive, LLVMRelocPIC,
                                     LLVMCodeModelJITDefault);
    if (!tm_jit) {
        snprintf(why, cap, "LLVM error: cannot create a target machine for %s (%s)", triple,
                 g.cpu);
        goto fail;
    }
    builder = LLVMOrcCreateLLJITBuilder();
    LLVMOrcLLJITBuilderSetJITTargetMachineBuilder(
        builder, LLVMOrcJITTargetMachineBuilderCreateFromTargetMachine(tm_jit));
    tm_jit = NULL; /* owned by the builder */
    LLVMErrorRef err = LLVMOrcCreateLLJIT(&jit, builder);
    builder = NULL; /* consumed */
    if (err) {
        take_error(err, "create LLJIT", why, cap);
        goto fail;
    }
    LLVMOrcDefinitionGeneratorRef gen;
    err = LLVMOrcCreateDynamicLibrarySearchGeneratorForProcess(
        &gen, LLVMOrcLLJITGetGlobalPrefix(jit), NULL, NULL);
    if (err) {
        take_error(err, "process symbols", why, cap);
        goto fail;
    }
    LLVMOrcJITDylibAddGenerator(LLVMOrcLLJITGetMainJITDylib(jit), gen);
    LLVMOrcExecutionSessionSetErrorReporter(LLVMOrcLLJITGetExecutionSession(jit),
                                            session_reporter, NULL);
    gj_rt_free(g.triple);
    gj_rt_free(g.layout);
    g.triple = dup_str(LLVMOrcLLJITGetTripleString(jit));
    g.layout = dup_str(LLVMOrcLLJITGetDataLayoutStr(jit));
    if (!g.triple || !g.layout) {
        snprintf(why, cap, "out of memory");
        goto fail;
    }
    g.jit = jit;
    LLVMDisposeMessage(triple);
    return 0;
fail:
    if (jit) {
        LLVMErrorRef e2 = LLVMOrcDisposeLLJIT(jit);
        if (e2) LLVMConsumeError(e2);
    }
    if (builder) LLVMOrcDisposeLLJITBuilder(builder);
    if (tm_jit) LLVMDisposeTargetMachine(tm_jit);
    LLVMDisposeMessage(triple);
    return -1;
}

/* Parses an embedded bitcode module (what: its name in messages) into M's
 * context and links it into M, making every gj_bc_* function internal so
 * it inlines: the scalar math (gj_rt_math_bc) into every module, the fused
 * attention (gj_rt_attn_bc) into those with an attention kernel. */
static int link_bitcode(LLVMModuleRef M, const unsigned char *blob, size_t size, const char *what,
                        char *why, size_t cap) {
    LLVMContextRef C = LLVMGetModuleContext(M);
    LLVMMemoryBufferRef buf =
        LLVMCreateMemoryBufferWithMemoryRange((const char *)blob, size, what, 0);
    LLVMModuleRef bc = NULL;
    LLVMBool bad = LLVMParseBitcodeInContext2(C, buf, &bc);
    LLVMDisposeMemoryBuffer(buf);
    if (bad || !bc) {
        snprintf(why, cap, "LLVM error: the embedded %s bitcode does not parse", what);
        return -1;
    }
    LLVMSetTarget(bc, g.triple);
    LLVMSetDataLayout(bc, g.layout);
    if (LLVMLinkModules2(M, bc) != 0) { /* bc is destroyed either way */
        snprintf(why, cap, "LLVM error: linking the %s bitcode failed", what);
        return -1;
    }
    for (LLVMValueRef f = LLVMGetFirstFunction(M); f; f = LLVMGetNextFunction(f)) {
        size_t n;
        const char *name = LLVMGetValueName2(f, &n);
        if (n < 6 || strncmp(name, "gj_bc_", 6) != 0 || LLVMIsDeclaration(f)) continue;
        LLVMSetLinkage(f, LLVMInternalLinkage);
        LLVMRemoveStringAttributeAtIndex(f, LLVMAttributeFunctionIndex, "target-cpu", 10);
        LLVMRemoveStringAttributeAtIndex(f, LLVMAttributeFunctionIndex, "target-features", 15);
        LLVMRemoveStringAttributeAtIndex(f, LLVMAttributeFunctionIndex, "tune-cpu", 8);
    }
    return 0;
}

/* Deletes the linked math functions no kernel calls (directly or through
 * another math function), so the optimiser and code generator only see
 * what is used. */
static void drop_unused_math(LLVMModuleRef M) {
    for (bool changed = true; changed;) {
        changed = false;
        for (LLVMValueRef f = LLVMGetFirstFunction(M), next; f; f = next) {
            next = LLVMGetNextFunction(f);
            size_t n;
            const char *name = LLVMGetValueName2(f, &n);
            if (n < 6 || strncmp(name, "gj_bc_", 6) != 0 || LLVMGetFirstUse(f)) continue;
            LLVMDeleteFunction(f);
            changed = true;
        }
    }
}

/* The live code object whose symbols have prefix `prefix`, or NULL (lock
 * held). */
static gj_jit_code *live_find(const char *prefix) {
    for (gj_jit_code *c = g.live; c; c = c->live_next)
        if (strcmp(c->prefix, prefix) == 0) return c;
    return NULL;
}

/* Looks up `<prefix>_<name>` of every kernel of p that is not shared and
 * stores it in the kernel's fn (lock held). 0, or -1 with why[] set. */
static int lookup_kernels(gj_jit_plan *p, const char *prefix, char *why, size_t why_cap) {
    for (int s = 0; s < p->n_instrs; s++) {
        gj_jit_kernel *k = &p->instrs[s].k;
        if (p->instrs[s].kind != GJ_JIT_INSTR_KERNEL || k->shared) continue;
        char name[128];
        snprintf(name, sizeof name, "%s_%s", prefix, k->name);
        LLVMOrcExecutorAddress addr = 0;
        LLVMErrorRef err = LLVMOrcLLJITLookup(g.jit, &addr, name);
        if (err) {
            take_error(err, "lookup", why, why_cap);
            return -1;
        }
        k->fn = (gj_rt_range_fn)(uintptr_t)addr;
    }
    return 0;
}

/* Unsets the fn of every kernel of p that is not shared (a failed add). */
static void unset_kernels(gj_jit_plan *p) {
    for (int s = 0; s < p->n_instrs; s++)
        if (!p->instrs[s].k.shared) p->instrs[s].k.fn = NULL;
}

/* A new code object for prefix, with one reference and (keep) a copy of
 * obj. NULL with why[] set. */
static gj_jit_code *new_code(const char *prefix, const void *obj, size_t n, bool keep, char *why,
                             size_t why_cap) {
    gj_jit_code *code = gj_rt_calloc(1, sizeof *code);
    if (!code) {
        snprintf(why, why_cap, "out of memory");
        return NULL;
    }
    atomic_init(&code->refs, 1);
    snprintf(code->prefix, sizeof code->prefix, "%s", prefix);
    if (keep && n > 0) {
        code->obj = gj_rt_malloc(n);
        if (!code->obj) {
            gj_rt_free(code);
            snprintf(why, why_cap, "out of memory");
            return NULL;
        }
        memcpy(code->obj, obj, n);
    }
    return code;
}

/* Adds obj's object files to the JIT under rt: one, or several behind
 * GJ_MULTI_MAGIC (a count, the sizes, then the objects). *parts receives
 * their number. 0, or -1 with why[] set (what was added stays under rt). */
static int add_objects_rt(LLVMOrcResourceTrackerRef rt, const char *prefix, const void *obj,
                          size_t n, int *parts, char *why, size_t why_cap) {
    LLVMErrorRef err;
    const char *bytes = obj;
    *parts = 1;
    if (n >= 8 && memcmp(bytes, GJ_MULTI_MAGIC, 4) == 0) { /* several objects */
        uint32_t cnt;
        memcpy(&cnt, bytes + 4, 4);
        size_t off = 8 + 8 * (size_t)cnt;
        if (cnt < 1 || cnt > GJ_JIT_MAX_SHARDS || off > n) {
            snprintf(why, why_cap, "LLVM error (add object): malformed multi-object code");
            return -1;
        }
        for (uint32_t i = 0; i < cnt; i++) {
            uint64_t sz;
            memcpy(&sz, bytes + 8 + 8 * (size_t)i, 8);
            if (sz > n - off) {
                snprintf(why, why_cap, "LLVM error (add object): malformed multi-object code");
                return -1;
            }
            LLVMMemoryBufferRef mb =
                LLVMCreateMemoryBufferWithMemoryRangeCopy(bytes + off, (size_t)sz, prefix);
            err = LLVMOrcLLJITAddObjectFileWithRT(g.jit, rt, mb); /* consumes mb */
            if (err) {
                take_error(err, "add object", why, why_cap);
                return -1;
            }
            off += (size_t)sz;
        }
        *parts = (int)cnt;
    } else {
        LLVMMemoryBufferRef mb = LLVMCreateMemoryBufferWithMemoryRangeCopy(bytes, n, prefix);
        err = LLVMOrcLLJITAddObjectFileWithRT(g.jit, rt, mb); /* consumes mb */
        if (err) {
            take_error(err, "add object", why, why_cap);
            return -1;
        }
    }
    return 0;
}

/* The tests' forced LLVM failure (gj_jit_fail_llvm, base/settings.c): a
 * lookup of a symbol no object defines. 0 when not asked, else -1 with
 * why[] set. */
static int forced_failure(char *why, size_t why_cap) {
    if (!gj_jit_fail_llvm()) return 0;
    LLVMOrcExecutorAddress addr = 0;
    LLVMErrorRef err = LLVMOrcLLJITLookup(g.jit, &addr, "gradjit_test_forced_llvm_failure");
    if (err) {
        take_error(err, "lookup", why, why_cap);
        return -1;
    }
    snprintf(why, why_cap, "LLVM error: forced failure did not fail");
    return -1;
}

/* Adds object code obj (copied; a further copy kept in the code when
 * `keep`) to the JIT under a new resource tracker and, when p is not NULL,
 * looks up every kernel of p (`<prefix>_<name>`). Object code whose prefix
 * a live code object already has is that code's (the same kernels, lent to
 * another program's disk entry): it is not added twice, the live one gets a
 * reference instead. Lock held. Returns the code or NULL with why[] set. */
static gj_jit_code *add_object(gj_jit_plan *p, const char *prefix, const void *obj, size_t n,
                               bool keep, char *why, size_t why_cap) {
    if (strlen(prefix) >= GJ_JIT_PREFIX_MAX) {
        snprintf(why, why_cap, "LLVM error (add object): symbol prefix too long");
        return NULL;
    }
    gj_jit_code *live = live_find(prefix);
    if (live) {
        if (p && lookup_kernels(p, prefix, why, why_cap) != 0) {
            unset_kernels(p);
            return NULL;
        }
        if (keep && !live->obj && n > 0) { /* the same bytes: keep them now */
            live->obj = gj_rt_malloc(n);
            if (live->obj) memcpy(live->obj, obj, n);
        }
        atomic_fetch_add(&live->refs, 1);
        return live;
    }
    gj_jit_code *code = new_code(prefix, obj, n, keep, why, why_cap);
    if (!code) return NULL;
    LLVMOrcResourceTrackerRef rt =
        LLVMOrcJITDylibCreateResourceTracker(LLVMOrcLLJITGetMainJITDylib(g.jit));
    int parts = 1;
    int rc = add_objects_rt(rt, prefix, obj, n, &parts, why, why_cap);
    if (rc == 0) {
        g.session_error[0] = '\0';
        if (p && lookup_kernels(p, prefix, why, why_cap) != 0) rc = -1;
    }
    if (rc == 0) rc = forced_failure(why, why_cap);
    if (rc != 0) { /* the tracker removes what was added */
        LLVMErrorRef e2 = LLVMOrcResourceTrackerRemove(rt);
        if (e2) LLVMConsumeError(e2);
        LLVMOrcReleaseResourceTracker(rt);
        gj_rt_free(code->obj);
        gj_rt_free(code);
        if (p) unset_kernels(p);
        return NULL;
    }
    code->rt = rt;
    code->obj_bytes = n;
    code->parts = parts;
    code->live_next = g.live;
    if (g.live) g.live->live_prev = code;
    g.live = code;
    return code;
}

/* --------------------------------------------------- parallel compile */

/* A program's distinct kernels are lowered into up to GJ_JIT_MAX_SHARDS
 * modules, each in its own LLVM context with its own target machine, and
 * optimised and compiled to object code on as many threads at once (the
 * caller runs shard 0). Several objects travel as one blob:
 *     "GJMO" | u32 count | count x u64 size | the objects, in order
 * (an ELF object never starts with "GJMO"); add_object takes either. */

typedef struct shard_job {
    gj_jit_plan *p;
    const char *prefix;
    const int *shard_of_instr;
    int shard;
    LLVMMemoryBufferRef obj; /* out */
    double t[4];             /* bitcode, IR, passes, codegen (ms, when prof) */
    char why[512];
} shard_job;

/* Whether shard j lowers an attention kernel. */
static bool shard_has_attn(const shard_job *j) {
    for (int s = 0; s < j->p->n_instrs; s++)
        if (j->p->instrs[s].kind == GJ_JIT_INSTR_KERNEL && j->p->instrs[s].k.attn &&
            !j->p->instrs[s].k.shared && (!j->shard_of_instr || j->shard_of_instr[s] == j->shard))
            return true;
    return false;
}

/* Lowers, optimises and compiles shard j->shard of j->p into j->obj. Runs
 * with g_lock held by the thread that started the compile; reads only g's
 * target description. */
static void *compile_shard(void *arg) {
    shard_job *j = arg;
    bool prof = (gj_jit_log_flags() & GJ_JIT_LOG_PROF) != 0;
    double t0 = prof ? gj_jit_now_ms() : 0, t1 = t0, t2 = t0, t3 = t0;
    LLVMContextRef C = LLVMContextCreate();
    LLVMModuleRef M = LLVMModuleCreateWithNameInContext(j->prefix, C);
    LLVMPassBuilderOptionsRef opts = NULL;
    LLVMTargetMachineRef tm = NULL;
    char *msg = NULL;
    LLVMTargetRef target;
    LLVMSetTarget(M, g.triple);
    LLVMSetDataLayout(M, g.layout);
    if (link_bitcode(M, gj_rt_math_bc, gj_rt_math_bc_size, "math", j->why, sizeof j->why) != 0)
        goto done;
    if (shard_has_attn(j) && link_bitcode(M, gj_rt_attn_bc, gj_rt_attn_bc_size, "attention",
                                          j->why, sizeof j->why) != 0)
        goto done;
    t1 = prof ? gj_jit_now_ms() : 0;
    if (gj_jit_lower_plan(M, j->p, j->prefix, g.cpu, g.features, j->shard_of_instr, j->shard,
                          j->why, sizeof j->why) != 0)
        goto done;
    drop_unused_math(M);
    t2 = prof ? gj_jit_now_ms() : 0;
    if (LLVMVerifyModule(M, LLVMReturnStatusAction, &msg) != 0) {
        snprintf(j->why, sizeof j->why, "LLVM error (verifier): %.400s", msg ? msg : "?");
        goto done;
    }
    LLVMDisposeMessage(msg);
    msg = NULL;
    /* a target machine per thread: LLVM's are not safe to share */
    if (LLVMGetTargetFromTriple(g.triple, &target, &msg) != 0 ||
        !(tm = LLVMCreateTargetMachine(target, g.triple, g.cpu, g.features,
                                       LLVMCodeGenLevelAggressive, LLVMRelocPIC,
                                       LLVMCodeModelJITDefault))) {
        snprintf(j->why, sizeof j->why, "LLVM error: cannot create a target machine for %s: %s",
                 g.triple, msg ? msg : "?");
        goto done;
    }
    opts = LLVMCreatePassBuilderOptions();
    LLVMPassBuilderOptionsSetLoopVectorization(opts, 1);
    LLVMPassBuilderOptionsSetSLPVectorization(opts, 1);
    LLVMPassBuilderOptionsSetLoopUnrolling(opts, 1);
    LLVMPassBuilderOptionsSetLoopInterleaving(opts, 1);
    LLVMErrorRef err = LLVMRunPasses(M, "default<O3>", tm, opts);
    if (err) {
        take_error(err, "optimisation", j->why, sizeof j->why);
        goto done;
    }
    t3 = prof ? gj_jit_now_ms() : 0;
    if (gj_jit_log_flags() & GJ_JIT_LOG_IR) {
        char *ir = LLVMPrintModuleToString(M);
        fprintf(stderr, "[gradjit ir] module %s (part %d)\n%s\n", j->prefix, j->shard, ir);
        LLVMDisposeMessage(ir);
    }
    if (LLVMTargetMachineEmitToMemoryBuffer(tm, M, LLVMObjectFile, &msg, &j->obj) != 0) {
        snprintf(j->why, sizeof j->why, "LLVM error (code generation): %.400s", msg ? msg : "?");
        j->obj = NULL;
    }
done:
    if (prof) {
        double t4 = gj_jit_now_ms();
        j->t[0] = t1 - t0;
        j->t[1] = t2 - t1;
        j->t[2] = t3 - t2;
        j->t[3] = t4 - t3;
    }
    if (msg) LLVMDisposeMessage(msg);
    if (opts) LLVMDisposePassBuilderOptions(opts);
    if (tm) LLVMDisposeTargetMachine(tm);
    LLVMDisposeModule(M);
    LLVMContextDispose(C);
    return NULL;
}

/* LLVM creates some process-wide objects (timer groups, option registries)
 * lazily, the first time a pass pipeline or code generator runs, guarded
 * by its own atomics and locks. They are invisible to ThreadSanitizer (the
 * LLVM library is not instrumented), which then reports the first two
 * concurrent compiles as a race. So the first parallel compile of the
 * process is preceded by one small compile on the calling thread: a loop
 * over floats through default<O3> and code generation, whose objects the
 * compile threads then find made (thread creation orders them). Lock held. */
static bool g_warmed;

static void warm_up(void) {
    if (g_warmed) return;
    g_warmed = true;
    LLVMContextRef C = LLVMContextCreate();
    LLVMModuleRef M = LLVMModuleCreateWithNameInContext("gj_warm", C);
    LLVMSetTarget(M, g.triple);
    LLVMSetDataLayout(M, g.layout);
    LLVMTypeRef i64 = LLVMInt64TypeInContext(C), f32 = LLVMFloatTypeInContext(C),
                ptr = LLVMPointerTypeInContext(C, 0);
    LLVMTypeRef args[2] = {ptr, i64};
    LLVMTypeRef fty = LLVMFunctionType(LLVMVoidTypeInContext(C), args, 2, 0);
    LLVMValueRef f = LLVMAddFunction(M, "gj_warm", fty);
    LLVMBasicBlockRef entry = LLVMAppendBasicBlockInContext(C, f, "entry"),
                      loop = LLVMAppendBasicBlockInContext(C, f, "loop"),
                      out = LLVMAppendBasicBlockInContext(C, f, "out");
    LLVMBuilderRef B = LLVMCreateBuilderInContext(C);
    LLVMPositionBuilderAtEnd(B, entry); /* for (i = 0; i < n; i++) p[i] = p[i] * 2 */
    LLVMValueRef zero = LLVMConstInt(i64, 0, 0);
    LLVMBuildCondBr(B, LLVMBuildICmp(B, LLVMIntSGT, LLVMGetParam(f, 1), zero, ""), loop, out);
    LLVMPositionBuilderAtEnd(B, loop);
    LLVMValueRef i = LLVMBuildPhi(B, i64, "i");
    LLVMValueRef at = LLVMBuildGEP2(B, f32, LLVMGetParam(f, 0), &i, 1, "");
    LLVMValueRef v = LLVMBuildFMul(B, LLVMBuildLoad2(B, f32, at, ""), LLVMConstReal(f32, 2.0), "");
    LLVMBuildStore(B, v, at);
    LLVMValueRef next = LLVMBuildAdd(B, i, LLVMConstInt(i64, 1, 0), "");
    LLVMAddIncoming(i, &zero, &entry, 1);
    LLVMAddIncoming(i, &next, &loop, 1);
    LLVMBuildCondBr(B, LLVMBuildICmp(B, LLVMIntSLT, next, LLVMGetParam(f, 1), ""), loop, out);
    LLVMPositionBuilderAtEnd(B, out);
    LLVMBuildRetVoid(B);
    LLVMDisposeBuilder(B);
    LLVMTargetRef target;
    char *msg = NULL;
    LLVMTargetMachineRef tm = NULL;
    if (LLVMGetTargetFromTriple(g.triple, &target, &msg) == 0)
        tm = LLVMCreateTargetMachine(target, g.triple, g.cpu, g.features,
                                     LLVMCodeGenLevelAggressive, LLVMRelocPIC,
                                     LLVMCodeModelJITDefault);
    if (msg) LLVMDisposeMessage(msg);
    msg = NULL;
    if (tm) { /* failures here are the real compile's to report */
        LLVMPassBuilderOptionsRef opts = LLVMCreatePassBuilderOptions();
        LLVMPassBuilderOptionsSetLoopVectorization(opts, 1);
        LLVMPassBuilderOptionsSetSLPVectorization(opts, 1);
        LLVMPassBuilderOptionsSetLoopUnrolling(opts, 1);
        LLVMPassBuilderOptionsSetLoopInterleaving(opts, 1);
        LLVMErrorRef err = LLVMRunPasses(M, "default<O3>", tm, opts);
        if (err) LLVMConsumeError(err);
        LLVMMemoryBufferRef obj = NULL;
        if (LLVMTargetMachineEmitToMemoryBuffer(tm, M, LLVMObjectFile, &msg, &obj) == 0)
            LLVMDisposeMemoryBuffer(obj);
        if (msg) LLVMDisposeMessage(msg);
        LLVMDisposePassBuilderOptions(opts);
        LLVMDisposeTargetMachine(tm);
    }
    LLVMDisposeModule(M);
    LLVMContextDispose(C);
}

/* A rough guess of the time LLVM takes over kernel k, for balancing the
 * modules: a loop costs more than a scalar kernel and a reduction more
 * still (its vectorised form); inlined transcendental math dominates the
 * rest (a tanh, exp or GELU derivative becomes a long vectorised body). */
static long kernel_cost(const gj_jit_kernel *k) {
    int64_t numel = 1;
    for (int d = 0; d < k->nd; d++) numel *= k->dims[d];
    long c = numel > 1 ? 12 : 4;
    if (k->red) c += 16;
    for (int e = 0; e < k->n_ex; e++) {
        const gj_jit_expr *x = &k->ex[e];
        if (x->kind == GJ_JIT_E_LOAD) {
            c += 2;
        } else if (x->kind == GJ_JIT_E_OP) {
            switch (x->inst.prim) { /* weights from compile times of W1-W5 and F1 */
            case GJ_P_GELU: case GJ_P_GELU_GRAD:
                c += 30;
                break;
            case GJ_P_EXP: case GJ_P_LOG: case GJ_P_TANH: case GJ_P_SIGMOID: case GJ_P_POW_SCALAR:
                c += 10;
                break;
            case GJ_P_CAST: /* bf16 rounding; f64 accumulation of f32 values */
                c += x->dtype == GJ_BF16 ? 6 : x->dtype == GJ_F64 ? 12 : 1;
                break;
            default:
                c += 1;
            }
        }
    }
    for (int q = 0; q < k->n_st; q++) c += k->st[q].reduce ? 4 : 2;
    return c;
}

/* How many modules p's kernels are compiled in, and which one each kernel
 * instruction's function goes to (shard_of_instr, -1 for other instructions): distinct
 * kernels, largest first (kernel_cost), each to the module with
 * the least so far; instructions sharing a function (dedupe.c) share its module.
 * One module when there is one thread or fewer than 2 distinct kernels. */
static int plan_shards(const gj_jit_plan *p, int *shard_of_instr) {
    int n_distinct = 0, threads = gj_rt_num_threads();
    for (int s = 0; s < p->n_instrs; s++) {
        shard_of_instr[s] = -1;
        if (p->instrs[s].kind != GJ_JIT_INSTR_KERNEL || p->instrs[s].k.shared) continue;
        bool seen = false;
        for (int t = 0; t < s && !seen; t++)
            seen = shard_of_instr[t] >= 0 && strcmp(p->instrs[t].k.name, p->instrs[s].k.name) == 0;
        if (!seen) n_distinct++;
        shard_of_instr[s] = 0;
    }
    int n = threads < GJ_JIT_MAX_SHARDS ? threads : GJ_JIT_MAX_SHARDS;
    if (n > n_distinct) n = n_distinct;
    if (n < 2) return 1;
    long load[GJ_JIT_MAX_SHARDS] = {0};
    for (int s = 0; s < p->n_instrs; s++) /* (a shared kernel is not compiled here) */
        shard_of_instr[s] = p->instrs[s].kind == GJ_JIT_INSTR_KERNEL && !p->instrs[s].k.shared ? -2 : -1;
    for (;;) { /* the largest unassigned distinct kernel */
        int best = -1;
        long best_cost = -1;
        for (int s = 0; s < p->n_instrs; s++) {
            if (shard_of_instr[s] != -2) continue;
            long cost = kernel_cost(&p->instrs[s].k);
            if (cost > best_cost) best = s, best_cost = cost;
        }
        if (best < 0) break;
        int lo = 0;
        for (int i = 1; i < n; i++)
            if (load[i] < load[lo]) lo = i;
        load[lo] += best_cost;
        for (int s = 0; s < p->n_instrs; s++) /* every instruction with this function */
            if (shard_of_instr[s] == -2 && strcmp(p->instrs[s].k.name, p->instrs[best].k.name) == 0)
                shard_of_instr[s] = lo;
    }
    return n;
}

gj_jit_code *gj_jit_code_compile(gj_jit_plan *p, const char *prefix, bool keep, char *why,
                                 size_t why_cap) {
    gj_jit_code *code = NULL;
    shard_job job[GJ_JIT_MAX_SHARDS];
    pthread_t tid[GJ_JIT_MAX_SHARDS];
    bool started[GJ_JIT_MAX_SHARDS] = {false};
    int *shard_of_instr = gj_rt_malloc((size_t)(p->n_instrs + 1) * sizeof(int));
    char *blob = NULL;
    size_t n = 0;
    int nshards = 0;
    why[0] = '\0';
    bool prof = (gj_jit_log_flags() & GJ_JIT_LOG_PROF) != 0;
    double t0 = prof ? gj_jit_now_ms() : 0, t1 = t0, cpu0 = prof ? cpu_ms_now() : 0;
    if (!shard_of_instr) {
        snprintf(why, why_cap, "out of memory");
        goto out;
    }
    pthread_mutex_lock(&g_lock);
    if (ensure_jit(why, why_cap) != 0) goto done;
    nshards = plan_shards(p, shard_of_instr);
    if (nshards > 1) warm_up();
    for (int i = 0; i < nshards; i++) {
        job[i] = (shard_job){p, prefix, nshards > 1 ? shard_of_instr : NULL, i, NULL, {0}, ""};
        /* shards 1.. on their own threads; if one cannot start, the caller
         * runs it after its own */
        if (i > 0) started[i] = gj_rt_thread_start(&tid[i], compile_shard, &job[i]) == 0;
    }
    compile_shard(&job[0]);
    for (int i = 1; i < nshards; i++) {
        if (started[i]) pthread_join(tid[i], NULL);
        else compile_shard(&job[i]);
    }
    t1 = prof ? gj_jit_now_ms() : 0;
    for (int i = 0; i < nshards; i++)
        if (!job[i].obj) {
            snprintf(why, why_cap, "%s", job[i].why[0] ? job[i].why : "LLVM error: compilation failed");
            goto done;
        }
    if (nshards == 1) {
        n = LLVMGetBufferSize(job[0].obj);
        blob = gj_rt_malloc(n ? n : 1);
        if (blob) memcpy(blob, LLVMGetBufferStart(job[0].obj), n);
    } else {
        n = 8 + 8 * (size_t)nshards;
        for (int i = 0; i < nshards; i++) n += LLVMGetBufferSize(job[i].obj);
        blob = gj_rt_malloc(n);
        if (blob) {
            uint32_t cnt = (uint32_t)nshards;
            memcpy(blob, GJ_MULTI_MAGIC, 4);
            memcpy(blob + 4, &cnt, 4);
            size_t off = 8 + 8 * (size_t)nshards;
            for (int i = 0; i < nshards; i++) {
                uint64_t sz = LLVMGetBufferSize(job[i].obj);
                memcpy(blob + 8 + 8 * (size_t)i, &sz, 8);
                memcpy(blob + off, LLVMGetBufferStart(job[i].obj), sz);
                off += sz;
            }
        }
    }
    if (!blob) {
        snprintf(why, why_cap, "out of memory");
        goto done;
    }
    if (live_find(prefix)) { /* compile into a live prefix: a caller's bug */
        snprintf(why, why_cap, "LLVM error: symbol prefix %s is in use", prefix);
        goto done;
    }
    code = add_object(p, prefix, blob, n, keep, why, why_cap);
    if (prof) {
        double tb = 0, ti = 0, to = 0, tc = 0;
        for (int i = 0; i < nshards; i++) {
            tb += job[i].t[0];
            ti += job[i].t[1];
            to += job[i].t[2];
            tc += job[i].t[3];
        }
        fprintf(stderr,
                "[gradjit prof] compile %s: %.1f ms in %d part%s (summed over parts: math bitcode "
                "%.1f ms, IR %.1f ms, O3 %.1f ms, codegen %.1f ms), load %.1f ms (%zu bytes; %.1f "
                "ms of CPU on this thread)\n",
                prefix, t1 - t0, nshards, nshards > 1 ? "s" : "", tb, ti, to, tc, gj_jit_now_ms() - t1, n,
                cpu_ms_now() - cpu0);
    }
done:
    for (int i = 0; i < nshards; i++)
        if (job[i].obj) LLVMDisposeMemoryBuffer(job[i].obj);
    pthread_mutex_unlock(&g_lock);
out:
    gj_rt_free(blob);
    gj_rt_free(shard_of_instr);
    if (!code) {
        for (int s = 0; s < p->n_instrs; s++)
            if (!p->instrs[s].k.shared) p->instrs[s].k.fn = NULL;
        if (!why[0]) snprintf(why, why_cap, "LLVM error: compilation failed");
        gj_rt_set_error("jit: %s", why);
    }
    return code;
}

gj_jit_code *gj_jit_code_load(gj_jit_plan *p, const char *prefix, const void *obj, size_t n,
                              bool keep, char *why, size_t why_cap) {
    gj_jit_code *code = NULL;
    why[0] = '\0';
    pthread_mutex_lock(&g_lock);
    if (ensure_jit(why, why_cap) == 0) code = add_object(p, prefix, obj, n, keep, why, why_cap);
    pthread_mutex_unlock(&g_lock);
    if (!code && !why[0]) snprintf(why, why_cap, "LLVM error: loading object code failed");
    return code;
}

const char *gj_jit_host_id(void) {
    static char id[1024];
    char why[256];
    pthread_mutex_lock(&g_lock);
    if (!id[0] && ensure_jit(why, sizeof why) == 0) {
        uint64_t h[2], a[2]; /* the math and the attention the kernels inline */
        gj_jit_hash128(gj_rt_math_bc, gj_rt_math_bc_size, h);
        gj_jit_hash128(gj_rt_attn_bc, gj_rt_attn_bc_size, a);
        snprintf(id, sizeof id, "llvm %s | %s | %s | %s | math %016llx%016llx | attention "
                 "%016llx%016llx",
                 LLVM_VERSION_STRING, g.triple, g.cpu, g.features, (unsigned long long)h[0],
                 (unsigned long long)h[1], (unsigned long long)a[0], (unsigned long long)a[1]);
    }
    pthread_mutex_unlock(&g_lock);
    return id;
}

void gj_jit_code_ref(gj_jit_code *c) {
    if (c) atomic_fetch_add(&c->refs, 1);
}

int gj_jit_code_refs(const gj_jit_code *c) { return c ? atomic_load(&((gj_jit_code *)c)->refs) : 0; }

gj_rt_range_fn gj_jit_code_lookup(gj_jit_code *c, const char *sym) {
    if (!c || strncmp(sym, c->prefix, strlen(c->prefix)) != 0) return NULL;
    LLVMOrcExecutorAddress addr = 0;
    pthread_mutex_lock(&g_lock);
    LLVMErrorRef err = g.jit ? LLVMOrcLLJITLookup(g.jit, &addr, sym) : NULL;
    if (err) {
        LLVMConsumeError(err);
        addr = 0;
    }
    pthread_mutex_unlock(&g_lock);
    return (gj_rt_range_fn)(uintptr_t)addr;
}

const char *gj_jit_code_prefix(const gj_jit_code *c) { return c ? c->prefix : ""; }

const void *gj_jit_code_object(const gj_jit_code *c, size_t *n) {
    *n = c && c->obj ? c->obj_bytes : 0;
    return c ? c->obj : NULL;
}

bool gj_jit_code_prefix_live(const char *prefix) {
    pthread_mutex_lock(&g_lock);
    bool live = live_find(prefix) != NULL;
    pthread_mutex_unlock(&g_lock);
    return live;
}

void gj_jit_code_free(gj_jit_code *c) {
    if (!c || atomic_fetch_sub(&c->refs, 1) > 1) return;
    pthread_mutex_lock(&g_lock);
    if (c->live_prev) c->live_prev->live_next = c->live_next;
    else if (g.live == c) g.live = c->live_next;
    if (c->live_next) c->live_next->live_prev = c->live_prev;
    if (c->rt) {
        LLVMErrorRef err = LLVMOrcResourceTrackerRemove(c->rt);
        if (err) LLVMConsumeError(err);
        LLVMOrcReleaseResourceTracker(c->rt);
        /* the kernels' names (unique per key) would stay interned forever */
        if (g.jit)
            LLVMOrcSymbolStringPoolClearDeadEntries(LLVMOrcExecutionSessionGetSymbolStringPool(
                LLVMOrcLLJITGetExecutionSession(g.jit)));
    }
    pthread_mutex_unlock(&g_lock);
    gj_rt_free(c->obj);
    gj_rt_free(c);
}

int gj_jit_code_parts(const gj_jit_code *c) { return c ? c->parts : 0; }

size_t gj_jit_code_bytes(const gj_jit_code *c) {
    if (!c) return 0;
    long pg = sysconf(_SC_PAGESIZE);
    size_t page = pg > 0 ? (size_t)pg : 4096;
    size_t kept = c->obj ? c->obj_bytes : 0; /* the copy kept for the disk cache */
    return (c->obj_bytes + page - 1) / page * page + 2 * page * (size_t)(c->parts > 0 ? c->parts : 1) +
           kept;
}

void gj_jit_llvm_shutdown(void) {
    pthread_mutex_lock(&g_lock);
    if (g.jit) {
        LLVMErrorRef err = LLVMOrcDisposeLLJIT(g.jit);
        if (err) LLVMConsumeError(err);
        g.jit = NULL;
    }
    if (g.cpu) LLVMDisposeMessage(g.cpu);
    if (g.features) LLVMDisposeMessage(g.features);
    g.cpu = g.features = NULL;
    gj_rt_free(g.triple);
    gj_rt_free(g.layout);
    g.triple = g.layout = NULL;
    pthread_mutex_unlock(&g_lock);
}
