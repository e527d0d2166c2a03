/* librgpu-worker.so's UCX: ucx_link.c with its functions exported, for the worker's Python
 * (remoting/datapath/worker/ucx.py), which calls them once per copy. */
#define RGPU_UCX_API __attribute__((visibility("default")))
#include "ucx_link.c"
