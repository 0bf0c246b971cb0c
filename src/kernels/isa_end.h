// End of a kernel file's code for its instruction set (isa_begin.h).
#pragma GCC pop_options
