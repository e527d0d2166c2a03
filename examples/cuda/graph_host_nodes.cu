// Host functions inside CUDA graphs, as NVIDIA's simpleCudaGraphs sample uses them: a stream
// capture with cudaLaunchHostFunc between device work, and a graph built with cudaGraphAddHostNode.
// Through rgpu the graph lives on the GPU node; each host function runs in this process, in graph
// order. `launch` adds kernels (a real GPU; the emulated device refuses launches).
// Prints ORDER, VALUES, HOSTNODE, BUILT and REPORTED lines and "GRAPHS OK" at the end.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

#define CHECK(x)                                                                        \
    do {                                                                                \
        cudaError_t e_ = (x);                                                           \
        if (e_ != cudaSuccess) {                                                        \
            printf("FAIL %s: %s\n", #x, cudaGetErrorString(e_));                        \
            return 1;                                                                   \
        }                                                                               \
    } while (0)

__global__ void add_one(int *p, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] += 1;
}

static int g_order[64];
static int g_count;

static void CUDART_CB mark(void *user) {
    if (g_count < 64) g_order[g_count++] = (int)(size_t)user;
}

// simpleCudaGraphs' callback: reads the result a copy node has just written into this process's
// memory, then resets it.
static int g_seen[8];
static int g_nseen;

static void CUDART_CB report(void *data) {
    int *result = (int *)data;
    if (g_nseen < 8) g_seen[g_nseen++] = *result;
    *result = 0;
}

static void print_order(const char *what) {
    printf("%s", what);
    for (int i = 0; i < g_count; i++) printf(" %d", g_order[i]);
    printf("\n");
}

int main(int argc, char **argv) {
    int launch = argc > 1 && !strcmp(argv[1], "launch");
    const int n = 256;
    int *da, *db;
    cudaStream_t s;
    CHECK(cudaSetDevice(0));
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CHECK(cudaMalloc(&da, n * sizeof(int)));
    CHECK(cudaMalloc(&db, n * sizeof(int)));

    // 1. Stream capture: memset, (kernel), host function, copy, (kernel), host function.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMemsetAsync(da, 0, n * sizeof(int), s));
    if (launch) add_one<<<1, n, 0, s>>>(da, n);
    CHECK(cudaLaunchHostFunc(s, mark, (void *)1));
    CHECK(cudaMemcpyAsync(db, da, n * sizeof(int), cudaMemcpyDeviceToDevice, s));
    if (launch) add_one<<<1, n, 0, s>>>(db, n);
    CHECK(cudaLaunchHostFunc(s, mark, (void *)2));
    CHECK(cudaStreamEndCapture(s, &graph));
    size_t nodes = 0;
    CHECK(cudaGraphGetNodes(graph, NULL, &nodes));
    printf("CAPTURED %zu nodes, %d host calls so far\n", nodes, g_count);
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; i++) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    print_order("ORDER");
    int ha[256], hb[256];
    CHECK(cudaMemcpy(ha, da, sizeof ha, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(hb, db, sizeof hb, cudaMemcpyDeviceToHost));
    printf("VALUES %d %d\n", ha[n - 1], hb[n - 1]);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));

    // 2. A graph built by hand: memset -> host node -> memset; its parameters read and replaced.
    g_count = 0;
    cudaGraphNode_t first, host, last;
    CHECK(cudaGraphCreate(&graph, 0));
    cudaMemsetParams ms = {};
    ms.dst = da;
    ms.value = 5;
    ms.elementSize = 4;
    ms.width = n;
    ms.height = 1;
    CHECK(cudaGraphAddMemsetNode(&first, graph, NULL, 0, &ms));
    cudaHostNodeParams hp = {};
    hp.fn = mark;
    hp.userData = (void *)10;
    CHECK(cudaGraphAddHostNode(&host, graph, &first, 1, &hp));
    ms.value = 6;
    ms.width = 1;
    CHECK(cudaGraphAddMemsetNode(&last, graph, &host, 1, &ms));
    cudaGraphNodeType type;
    CHECK(cudaGraphNodeGetType(host, &type));
    cudaHostNodeParams got = {};
    CHECK(cudaGraphHostNodeGetParams(host, &got));
    printf("HOSTNODE type %d fn %s user %d\n", (int)type, got.fn == mark ? "same" : "other", (int)(size_t)got.userData);
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CHECK(cudaGraphLaunch(exec, s));
    hp.userData = (void *)11;
    CHECK(cudaGraphExecHostNodeSetParams(exec, host, &hp));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    print_order("BUILT");
    CHECK(cudaMemcpy(ha, da, sizeof ha, cudaMemcpyDeviceToHost));
    printf("BUILT VALUES %d %d\n", ha[0], ha[1]);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));

    // 3. A copy node into this process's memory, then the host function that reads it.
    static int result_h = -1;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMemsetAsync(db, 1, n * sizeof(int), s));
    CHECK(cudaMemcpyAsync(&result_h, db, sizeof result_h, cudaMemcpyDeviceToHost, s));
    CHECK(cudaLaunchHostFunc(s, report, &result_h));
    CHECK(cudaStreamEndCapture(s, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 2; i++) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    printf("REPORTED %x %x RESULT %d\n", g_seen[0], g_seen[1], result_h);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaFree(da));
    CHECK(cudaFree(db));
    CHECK(cudaStreamDestroy(s));
    printf("GRAPHS OK\n");
    return 0;
}
