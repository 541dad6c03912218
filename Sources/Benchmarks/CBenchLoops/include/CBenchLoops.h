int tk_bench_placeholder(void);
