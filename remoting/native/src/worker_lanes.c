/* librgpu-worker.so's data lanes: lanes.c with its functions exported, for the worker's Python
 * (remoting/datapath/worker/lanes.py), which calls them once per striped copy. */
#define RGPU_LANES_API __attribute__((visibility("default")))
#include "lanes.c"
