#define NAME unfused
#include "kernels.inc"
