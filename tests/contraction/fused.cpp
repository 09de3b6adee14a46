#define NAME fused
#include "kernels.inc"
