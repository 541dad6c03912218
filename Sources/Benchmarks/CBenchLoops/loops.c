#include "CBenchLoops.h"
int tk_bench_placeholder(void) { return 0; }
