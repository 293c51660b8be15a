/* What the two AMX paths share (bf16_amx.h for bf16_linear.c, quant_amx.h for quant.c): Linux's
 * permission for the tiles' 8 KB of state, which a process must ask for (arch_prctl
 * ARCH_REQ_XCOMP_PERM), and loading a tile configuration.  The including .c file defines _GNU_SOURCE
 * (syscall). */
#ifndef PDKV_AMX_H
#define PDKV_AMX_H
#if defined(__AMX_TILE__)
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <immintrin.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 1 when Linux grants this process the tiles (asked at the first call, once). */
static int amx_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

/* Palette 1 with tiles 0 .. n - 1 of rows[t] rows of colsb[t] bytes (0 rows: unused). */
static void amx_configure_tiles(const int *rows, const int *colsb, int n) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < n; t++) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = (uint16_t)(rows[t] ? colsb[t] : 0);
    }
    /* gcc's _tile_loadconfig tells the compiler it reads 8 bytes of c: keep every store above it */
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}
#endif
#endif
