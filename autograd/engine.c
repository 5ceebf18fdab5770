/* SPDX-License-Identifier: MIT */
/*
 * engine.c - the backward traversal shared by both interpreters.
 *
 * gj_ag_run_backward discovers the graph reachable from the roots, counts
 * for each node how many edges of the graph point at it, and runs nodes in
 * dependency order: a node is ready once every node that feeds it has run,
 * so its gradient buffers are complete. Among ready nodes the most recently
 * created runs first (like PyTorch's sequence numbers): the order is a pure
 * function of the graph's structure, which is what makes a captured graph
 * and its cache key identical from run to run and across processes.
 *
 * Only "needed" nodes run: in backward mode those from which an accumulate
 * node is reachable, in gj_grad mode those from which a requested input is
 * reachable. Everything is validated (graph freed? saved tensor modified in
 * place?) before any gradient is produced, so an error leaves .grad as it
 * was.
 */
#include "ag.h"

#include <string.h>

static _Thread_local int g_no_grad_depth;

bool gj_ag_grad_enabled(void) { return g_no_grad_depth == 0; }
void gj_ag_no_grad_enter(void) { g_no_grad_depth++; }
void gj_ag_no_grad_exit(void) {
    if (g_no_grad_depth > 0) g_no_grad_depth--;
}

typedef struct task {
    gj_ag_node *node;          /* borrowed: the graph is kept alive by roots */
    int deps;                  /* edges of the graph pointing here, not yet run */
    bool needed, executed;
    gj_val *buf[GJ_AG_MAX_OUT]; /* summed incoming gradients (kept values) */
    bool capture;              /* an input of gj_grad points here */
} task;

typedef struct graph {
    task *tasks;
    int64_t n, cap;
    int64_t *slots; /* open addressing: node pointer -> task index + 1 */
    int64_t nslots;
} graph;

static uint64_t ptr_hash(const void *p) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
}

/* Index of node's task, or -1. */
static int64_t graph_find(const graph *g, const gj_ag_node *node) {
    if (!g->nslots) return -1;
    for (uint64_t h = ptr_hash(node) & (uint64_t)(g->nslots - 1);; h = (h + 1) & (uint64_t)(g->nslots - 1)) {
        int64_t s = g->slots[h];
        if (s == 0) return -1;
        if (g->tasks[s - 1].node == node) return s - 1;
    }
}

static int graph_rehash(graph *g, int64_t nslots) {
    int64_t *slots = gj_rt_calloc((size_t)nslots, sizeof *slots);
    if (!slots) return -1;
    for (int64_t i = 0; i < g->n; i++) {
        uint64_t h = ptr_hash(g->tasks[i].node) & (uint64_t)(nslots - 1);
        while (slots[h]) h = (h + 1) & (uint64_t)(nslots - 1);
        slots[h] = i + 1;
    }
    gj_rt_free(g->slots);
    g->slots = slots;
    g->nslots = nslots;
    return 0;
}

/* Adds node (if new); returns its index, or -1 on OOM. *added tells. */
static int64_t graph_add(graph *g, gj_ag_node *node, bool *added) {
    int64_t i = graph_find(g, node);
    *added = false;
    if (i >= 0) return i;
    if (g->n == g->cap) {
        int64_t cap = g->cap ? g->cap * 2 : 32;
        task *t = gj_rt_realloc(g->tasks, (size_t)cap * sizeof *t);
        if (!t) return -1;
        g->tasks = t;
        g->cap = cap;
    }
    memset(&g->tasks[g->n], 0, sizeof(task));
    g->tasks[g->n].node = node;
    g->n++;
    if (g->n * 2 > g->nslots && graph_rehash(g, g->nslots ? g->nslots * 2 : 64) != 0) {
        g->n--;
        return -1;
    }
    if (graph_find(g, node) < 0) { /* not inserted by the rehash: insert */
        uint64_t h = ptr_hash(node) & (uint64_t)(g->nslots - 1);
        while (g->slots[h]) h = (h + 1) & (uint64_t)(g->nslots - 1);
        g->slots[h] = g->n;
    }
    *added = true;
    return g->n - 1;
}

/* Discovers every node reachable from the start nodes (iterative DFS) and
 * counts dependencies. Returns 0 or -1 (OOM). */
static int graph_discover(graph *g, int n_start, gj_ag_node *const *start) {
    int64_t cap = 64, top = 0;
    gj_ag_node **stack = gj_rt_malloc((size_t)cap * sizeof *stack);
    if (!stack) return -1;
    for (int r = 0; r < n_start; r++) {
        bool added;
        if (!start[r]) continue;
        if (graph_add(g, start[r], &added) < 0) goto fail;
        if (added) stack[top++] = start[r];
        while (top > 0) {
            gj_ag_node *cur = stack[--top];
            for (int i = 0; i < cur->n_in; i++) {
                gj_ag_node *nx = cur->next[i].node;
                if (!nx) continue;
                int64_t j = graph_add(g, nx, &added);
                if (j < 0) goto fail;
                g->tasks[j].deps++;
                if (!added) continue;
                if (top == cap) {
                    gj_ag_node **s2 = gj_rt_realloc(stack, (size_t)cap * 2 * sizeof *s2);
                    if (!s2) goto fail;
                    stack = s2;
                    cap *= 2;
                }
                stack[top++] = nx;
            }
        }
    }
    gj_rt_free(stack);
    return 0;
fail:
    gj_rt_free(stack);
    return -1;
}

/* Topological order (parents before children) into order[0..n). */
static int graph_topo(graph *g, int64_t *order) {
    int64_t *deps = gj_rt_malloc((size_t)g->n * sizeof *deps);
    if (!deps) return -1;
    int64_t head = 0, tail = 0;
    for (int64_t i = 0; i < g->n; i++) {
        deps[i] = g->tasks[i].deps;
        if (deps[i] == 0) order[tail++] = i;
    }
    while (head < tail) {
        gj_ag_node *cur = g->tasks[order[head++]].node;
        for (int i = 0; i < cur->n_in; i++) {
            if (!cur->next[i].node) continue;
            int64_t j = graph_find(g, cur->next[i].node);
            if (--deps[j] == 0) order[tail++] = j;
        }
    }
    gj_rt_free(deps);
    return 0;
}

/* ---------------------------------------------------------- ready heap */

typedef struct heap {
    int64_t *items;
    int64_t n;
    const graph *g;
} heap;

static bool heap_before(const heap *h, int64_t a, int64_t b) {
    return h->g->tasks[a].node->seq > h->g->tasks[b].node->seq;
}

static void heap_push(heap *h, int64_t v) {
    int64_t i = h->n++;
    h->items[i] = v;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!heap_before(h, h->items[i], h->items[p])) break;
        int64_t t = h->items[i];
        h->items[i] = h->items[p];
        h->items[p] = t;
        i = p;
    }
}

static int64_t heap_pop(heap *h) {
    int64_t top = h->items[0];
    h->items[0] = h->items[--h->n];
    for (int64_t i = 0;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < h->n && heap_before(h, h->items[l], h->items[m])) m = l;
        if (r < h->n && heap_before(h, h->items[r], h->items[m])) m = r;
        if (m == i) break;
        int64_t t = h->items[i];
        h->items[i] = h->items[m];
        h->items[m] = t;
        i = m;
    }
    return top;
}

/* ------------------------------------------------------------- running */

/* buf += g (both values of b); g is borrowed, the buffer keeps its own. */
static int buf_add(gj_ag_builder *b, gj_val **buf, gj_val *g) {
    if (!*buf) {
        b->keep(b, g);
        *buf = g;
        return 0;
    }
    gj_val *s = gj_ag_binary(b, GJ_P_ADD, *buf, g);
    if (!s) return -1;
    b->keep(b, s);
    b->drop(b, *buf);
    *buf = s;
    return 0;
}


static bool same_meta(const gj_rt_meta *a, const gj_rt_meta *b) {
    return a->dtype == b->dtype && a->ndim == b->ndim &&
           memcmp(a->shape, b->shape, (size_t)a->ndim * sizeof a->shape[0]) == 0;
}

bool gj_ag_leaf_grad_fits(const gj_tensor *leaf, const gj_rt_meta *g, const char *op) {
    if (leaf->ndim == g->ndim &&
        memcmp(leaf->shape, g->shape, (size_t)g->ndim * sizeof g->shape[0]) == 0)
        return true;
    char was[96], now[96], nm[160];
    gj_rt_fmt_shape(was, sizeof was, g->ndim, g->shape);
    gj_rt_fmt_shape(now, sizeof now, leaf->ndim, leaf->shape);
    gj_rt_set_error("backward: the gradient of a leaf tensor%s has shape %s%s%s%s, but the leaf "
                    "is now %s %s: gj_tensor_set_ changed its shape after the forward used it "
                    "(AccumulateGrad expects a gradient of the leaf's shape)",
                    gj_rt_tensor_label(leaf, nm, sizeof nm), was, op ? " (the shape op " : "", op ? op : "", op ? " saw in the forward)" : "",
                    gj_rt_dtype_name(leaf->dtype), now);
    return false;
}

/* Checks every needed node can run: graph not freed, saved tensors not
 * modified in place since they were saved, leaves still of the shape the
 * forward saw (a gj_tensor_set_ between forward and backward). */
static int graph_validate(const graph *g) {
    for (int64_t i = 0; i < g->n; i++) {
        const task *t = &g->tasks[i];
        const gj_ag_node *n = t->node;
        if (!t->needed || n->kind != GJ_AG_OP) continue;
        for (int k = 0; k < n->n_in; k++) {
            const gj_ag_node *nx = n->next[k].node;
            if (nx && nx->kind == GJ_AG_ACCUMULATE && nx->leaf &&
                !gj_ag_leaf_grad_fits(nx->leaf, &n->in_meta[k], n->op->name))
                return -1;
        }
        if (n->released) {
            gj_rt_set_error("backward: trying to backward through the graph a second time "
                            "(op %s): its saved tensors were freed by the previous backward; "
                            "pass retain_graph=true to the first backward",
                            n->op->name);
            return -1;
        }
        for (int k = 0; k < n->n_saved; k++) {
            int64_t v = atomic_load(&n->saved[k].t->storage->version);
            if (v != n->saved[k].version) {
                char sh[96], nm[160];
                gj_rt_fmt_shape(sh, sizeof sh, n->saved[k].t->ndim, n->saved[k].t->shape);
                gj_rt_set_error("backward: a tensor%s saved by op %s (saved #%d, %s %s) was "
                                "modified by an in-place operation: it is at version %lld, "
                                "expected version %lld",
                                gj_rt_tensor_label(n->saved[k].t, nm, sizeof nm), n->op->name,
                                k, gj_rt_dtype_name(n->saved[k].t->dtype), sh, (long long)v,
                                (long long)n->saved[k].version);
                return -1;
            }
        }
    }
    return 0;
}

/* A builder without call_hook/call_post_hook cannot run a graph with
 * hooks: refuse before any gradient exists (both builders of the library
 * have them; the check protects any other builder). Nodes that may run hooks: needed, captured,
 * or a root's node (deps 0). */
static int graph_check_hooks(const graph *g, gj_ag_builder *b) {
    if (b->call_hook && b->call_post_hook) return 0;
    for (int64_t i = 0; i < g->n; i++) {
        const task *t = &g->tasks[i];
        if (!t->needed && !t->capture && t->deps != 0) continue;
        for (int k = 0; k < t->node->n_out; k++) {
            int nh = gj_ag_node_hooks(t->node, k, NULL, 0);
            if (nh == 0) continue;
            gj_rt_set_error("hooks: this builder cannot run hooks (%d hook(s) on output %d of "
                            "op %s)",
                            nh, k, t->node->kind == GJ_AG_OP ? t->node->op->name : "AccumulateGrad");
            return -1;
        }
    }
    return 0;
}

static int run_node(gj_ag_builder *b, graph *g, task *t, bool accumulate) {
    gj_ag_node *n = t->node;
    if (n->kind == GJ_AG_ACCUMULATE) {
        if (!accumulate || !t->buf[0]) return 0;
        gj_rt_meta gm;
        b->meta(b, t->buf[0], &gm);
        /* another thread's backward may write this .grad too: one at a time */
        if (!b->records) gj_ag_leaf_lock(n->leaf);
        int ar = gj_ag_leaf_grad_fits(n->leaf, &gm, NULL) /* set_ during backward */
                     ? b->accumulate(b, n->leaf, t->buf[0])
                     : -1;
        if (!b->records) gj_ag_leaf_unlock(n->leaf);
        if (ar != 0) return -1;
        return gj_ag_run_post_hooks(b, n->leaf); /* after .grad was written */
    }
    bool any = false, needs[GJ_AG_MAX_IN] = {0};
    for (int k = 0; k < n->n_out; k++) any |= t->buf[k] != NULL;
    bool want = false;
    for (int i = 0; i < n->n_in; i++) {
        if (!n->next[i].node) continue;
        needs[i] = g->tasks[graph_find(g, n->next[i].node)].needed;
        want |= needs[i];
    }
    if (!any || !want) return 0;
    gj_val *gin[GJ_AG_MAX_IN] = {0};
    if (gj_ag_node_backward(b, n, needs, t->buf, gin) != 0) return -1;
    for (int i = 0; i < n->n_in; i++) {
        if (!needs[i] || !gin[i]) continue;
        gj_rt_meta m;
        b->meta(b, gin[i], &m);
        if (!same_meta(&m, &n->in_meta[i])) {
            char got[96], want_s[96];
            gj_rt_fmt_shape(got, sizeof got, m.ndim, m.shape);
            gj_rt_fmt_shape(want_s, sizeof want_s, n->in_meta[i].ndim, n->in_meta[i].shape);
            gj_rt_set_error("backward: internal: op %s produced a gradient %s %s for input %d "
                            "of %s %s",
                            n->op->name, gj_rt_dtype_name(m.dtype), got, i,
                            gj_rt_dtype_name(n->in_meta[i].dtype), want_s);
            return -1;
        }
        if (gj_ag_anomaly() && gj_ag_anomaly_check(b, n, i, gin[i]) != 0) return -1;
        task *c = &g->tasks[graph_find(g, n->next[i].node)];
        if (buf_add(b, &c->buf[n->next[i].input_nr], gin[i]) != 0) return -1;
    }
    return 0;
}

int gj_ag_run_backward(gj_ag_builder *b, int n_roots, gj_tensor *const *roots,
                       gj_val *const *seeds, int n_inputs, gj_tensor *const *inputs,
                       gj_val **grads_out, bool retain_graph, bool accumulate) {
    graph g = {0};
    int rc = -1;
    gj_ag_edge *root_edges = gj_rt_calloc((size_t)n_roots + 1, sizeof *root_edges);
    gj_ag_edge *in_edges = gj_rt_calloc((size_t)n_inputs + 1, sizeof *in_edges);
    gj_ag_node **start = gj_rt_calloc((size_t)n_roots + 1, sizeof *start);
    int64_t *order = NULL;
    heap h = {0};
    if (!root_edges || !in_edges || !start) goto done;

    for (int r = 0; r < n_roots; r++) {
        root_edges[r] = gj_ag_edge_of(roots[r]);
        if (!root_edges[r].node) {
            gj_ag_tensor_meta *m = roots[r]->ag;
            if (!(m && m->requires_grad))
                gj_rt_set_error("backward: output %d does not require grad and has no grad_fn "
                                "(no input of its graph requires grad, or it was computed "
                                "under no_grad)",
                                r);
            goto done;
        }
        start[r] = root_edges[r].node;
    }
    if (graph_discover(&g, n_roots, start) != 0) goto done;
    for (int i = 0; i < n_inputs; i++) {
        in_edges[i] = gj_ag_edge_of(inputs[i]);
        if (!in_edges[i].node) {
            gj_ag_tensor_meta *m = inputs[i]->ag;
            if (!(m && m->requires_grad)) {
                gj_rt_set_error("gj_grad: input %d does not require grad", i);
                goto done;
            }
            goto done; /* OOM */
        }
        int64_t j = graph_find(&g, in_edges[i].node);
        if (j >= 0) g.tasks[j].capture = true;
    }

    /* needed: reverse topological order, children before parents */
    order = gj_rt_malloc((size_t)(g.n + 1) * sizeof *order);
    h.items = gj_rt_malloc((size_t)(g.n + 1) * sizeof *h.items);
    h.g = &g;
    if (!order || !h.items || graph_topo(&g, order) != 0) goto done;
    for (int64_t k = g.n - 1; k >= 0; k--) {
        task *t = &g.tasks[order[k]];
        t->needed = t->capture || (accumulate && t->node->kind == GJ_AG_ACCUMULATE);
        for (int i = 0; i < t->node->n_in && !t->needed; i++) {
            gj_ag_node *nx = t->node->next[i].node;
            if (nx && g.tasks[graph_find(&g, nx)].needed) t->needed = true;
        }
    }
    if (graph_validate(&g) != 0) goto done;
    if (graph_check_hooks(&g, b) != 0) goto done;

    for (int r = 0; r < n_roots; r++) {
        task *t = &g.tasks[graph_find(&g, root_edges[r].node)];
        if (buf_add(b, &t->buf[root_edges[r].input_nr], seeds[r]) != 0) goto done;
    }
    for (int64_t i = 0; i < g.n; i++)
        if (g.tasks[i].deps == 0) heap_push(&h, i);
    while (h.n > 0) {
        int64_t i = heap_pop(&h);
        task *t = &g.tasks[i];
        gj_ag_node *n = t->node;
        /* the gradients of n's outputs are complete: tensor hooks first */
        for (int k = 0; k < n->n_out; k++)
            if (t->buf[k] && gj_ag_run_tensor_hooks(b, n, k, &t->buf[k]) != 0) goto done;
        if (t->capture && !accumulate && b->captured && b->captured(b, n, t->buf) != 0) goto done;
        if (t->needed) {
            if (run_node(b, &g, t, accumulate) != 0) goto done;
            t->executed = true;
        }
        if (!t->capture) {
            for (int k = 0; k < n->n_out; k++) {
                b->drop(b, t->buf[k]);
                t->buf[k] = NULL;
            }
        }
        b->end_node(b);
        for (int e = 0; e < n->n_in; e++) {
            if (!n->next[e].node) continue;
            int64_t j = graph_find(&g, n->next[e].node);
            if (--g.tasks[j].deps == 0) heap_push(&h, j);
        }
    }
    for (int i = 0; i < n_inputs; i++) {
        int64_t j = graph_find(&g, in_edges[i].node);
        gj_val *v = j >= 0 ? g.tasks[j].buf[in_edges[i].input_nr] : NULL;
        if (v) b->keep(b, v); /* the caller's reference */
        grads_out[i] = v;
    }
    if (!retain_graph) {
        for (int64_t i = 0; i < g.n; i++)
            if (g.tasks[i].executed && g.tasks[i].node->kind == GJ_AG_OP)
                gj_ag_node_free_saved(g.tasks[i].node);
    }
    rc = 0;
done:
    for (int64_t i = 0; i < g.n; i++)
        for (int k = 0; k < GJ_AG_MAX_OUT; k++) b->drop(b, g.tasks[i].buf[k]);
    b->end_node(b);
    for (int r = 0; r < n_roots && root_edges; r++) gj_ag_node_release(root_edges[r].node);
    for (int i = 0; i < n_inputs && in_edges; i++) gj_ag_node_release(in_edges[i].node);
    gj_rt_free(root_edges);
    gj_rt_free(in_edges);
    gj_rt_free(start);
    gj_rt_free(order);
    gj_rt_free(h.items);
    gj_rt_free(g.tasks);
    gj_rt_free(g.slots);
    return rc;
}

/* ------------------------------------------------- running backwards */

/* The backwards running on this thread (entered with gj_ag_backward_enter
 * and not yet left), innermost last: each holds strong references to the
 * nodes its roots' gradients flow into, so that a backward started from
 * user code they call (a hook, a custom op's function) can be compared
 * with them while their own roots may already be released. */
#define RUNNING_MAX 32
typedef struct running {
    gj_ag_node **nodes; /* strong references */
    int n;
} running;
static _Thread_local running g_running[RUNNING_MAX];
static _Thread_local int g_n_running;

static void running_free(running *r) {
    for (int i = 0; i < r->n; i++) gj_ag_node_release(r->nodes[i]);
    gj_rt_free(r->nodes);
    r->nodes = NULL;
    r->n = 0;
}

/* The first node of g (a discovered graph) that is also reachable from
 * the nodes of r, or NULL (and *oom set when discovery ran out of
 * memory). */
static gj_ag_node *running_overlap(const graph *g, const running *r, bool *oom) {
    graph o = {0};
    gj_ag_node *hit = NULL;
    if (graph_discover(&o, r->n, r->nodes) != 0) {
        *oom = true;
    } else {
        for (int64_t i = 0; i < g->n && !hit; i++)
            if (graph_find(&o, g->tasks[i].node) >= 0) hit = g->tasks[i].node;
    }
    gj_rt_free(o.tasks);
    gj_rt_free(o.slots);
    return hit;
}

int gj_ag_backward_enter(int n_roots, gj_tensor *const *roots, const char *fn) {
    if (g_n_running == RUNNING_MAX) {
        gj_rt_set_error("%s: called from user code inside %d nested backwards running on this "
                        "thread (at most %d)",
                        fn, RUNNING_MAX, RUNNING_MAX);
        return -1;
    }
    running r = {gj_rt_calloc((size_t)n_roots + 1, sizeof *r.nodes), 0};
    if (!r.nodes) return -1;
    for (int i = 0; i < n_roots; i++) {
        gj_ag_edge e = gj_ag_edge_of(roots[i]);
        if (e.node) r.nodes[r.n++] = e.node; /* no node: the backward reports it */
    }
    if (g_n_running > 0 && r.n > 0) { /* nested: refuse a graph that is running */
        graph g = {0};
        gj_ag_node *hit = NULL;
        bool oom = graph_discover(&g, r.n, r.nodes) != 0;
        for (int k = 0; k < g_n_running && !hit && !oom; k++)
            hit = running_overlap(&g, &g_running[k], &oom);
        gj_rt_free(g.tasks);
        gj_rt_free(g.slots);
        if (hit)
            gj_rt_set_error("%s: called (from a hook or a custom op's function) on a graph whose "
                            "backward is running on this thread (node %s is in both): a graph "
                            "cannot be differentiated again before its running backward "
                            "returns",
                            fn, hit->kind == GJ_AG_OP ? hit->op->name : "AccumulateGrad");
        if (hit || oom) {
            running_free(&r);
            return -1;
        }
    }
    g_running[g_n_running++] = r;
    return 0;
}

void gj_ag_backward_exit(void) {
    if (g_n_running > 0) running_free(&g_running[--g_n_running]);
}

void gj_ag_node_free_saved(gj_ag_node *nd) {
    for (int k = 0; k < nd->n_saved; k++) {
        gj_rt_tensor_release(nd->saved[k].t);
        nd->saved[k].t = NULL;
    }
    nd->n_saved = 0;
    nd->released = true;
}

void gj_ag_release_graph(int n_roots, gj_tensor *const *roots) {
    graph g = {0};
    gj_ag_node **start = gj_rt_malloc(((size_t)n_roots + 1) * sizeof *start);
    if (!start) return;
    int n = 0;
    for (int r = 0; r < n_roots; r++) {
        gj_ag_tensor_meta *m = roots[r]->ag;
        if (m && m->node) start[n++] = m->node;
    }
    if (graph_discover(&g, n, start) == 0) {
        for (int64_t i = 0; i < g.n; i++)
            if (g.tasks[i].node->kind == GJ_AG_OP) gj_ag_node_free_saved(g.tasks[i].node);
    }
    gj_rt_free(start);
    gj_rt_free(g.tasks);
    gj_rt_free(g.slots);
}
