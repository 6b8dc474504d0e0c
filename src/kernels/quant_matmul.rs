//! Block-quantized matmul on the CPU with int8 dot products (AVX-512 VNNI, or AVX2): `y = x·Wᵀ` for the
//! GGUF weights of the default model (Q4_1 layers, a Q8_0 embedding as the tied LM head), and
//! Q4_0. candle's CPU kernel for Q4_1 is its scalar reference loop, so a decode step spent most
//! of its time there; llama.cpp's decode is int8 dot products over the same blocks.
//!
//! Every supported block format is an affine map of unsigned integers per block of 32 weights:
//! `w = d·u + m` (Q4_1: `u` the nibble; Q4_0: `m = −8d`; Q8_0: `u = q + 128`, `m = −128d`,
//! exact). Activations are quantized per block of 32 to int8 with a scale `dx` (as llama.cpp's
//! Q8_1), so one block's product is `d·dx·Σ u·q + m·dx·Σ q`, the sum exact in i32.
//!
//! Weights are repacked once, in panels of 16 output rows: for each block, the bytes of four
//! consecutive weights of the 16 rows sit side by side, so one `vpdpbusd` with a broadcast of
//! four activation bytes adds into one i32 lane per output row — no horizontal sums. The panel's
//! weights are unpacked once per block and reused for up to `TILE` activation rows, which is
//! what makes a batch of decoding sequences cheaper per row than one alone.
//!
//! Every output element is computed by the same sequence of operations whatever the number of
//! rows in the call or the tile it falls in, so a sequence's logits do not depend on who shares
//! its batch (continuous batching's exactness rests on that).

use half::f16;

/// Weights per quantization block of the kernel (all supported formats; a K-quant super-block
/// of 256 is read as 8 of them).
pub const BLOCK: usize = 32;
/// Output rows per panel: one 512-bit register of i32 lanes.
const PANEL: usize = 16;
/// Activation rows that share one unpacking of a panel's block.
const TILE: usize = 4;
/// Q6_K's integer offset: `w = d·(u − 32)` with `u` the 6-bit quant.
const Q6K_OFFSET: i32 = 32;

/// The GGUF block formats this kernel reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockFormat {
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    /// 256-weight super-blocks: 8 sub-blocks of 32 with 6-bit scales and mins.
    Q4K,
    /// 256-weight super-blocks: 16 sub-blocks of 16 with int8 scales, 6-bit quants.
    Q6K,
}

/// One 32-weight block of the kernel: `w[i] = d[i / 16]·(u[i] − offset) + m`, where `offset` is
/// 0 (and `d[0] = d[1]`) for the affine formats and [`Q6K_OFFSET`] (and `m = 0`) for Q6_K,
/// whose scale changes every 16 weights.
#[derive(Clone, Copy, Debug)]
struct Block {
    d: [f32; 2],
    m: f32,
    u: [u8; BLOCK],
}

impl Block {
    fn affine(d: f32, m: f32, u: [u8; BLOCK]) -> Self {
        Self { d: [d, d], m, u }
    }

    /// Weight `i` as the format's dequantization computes it (bit for bit).
    #[cfg(test)]
    fn weight(&self, i: usize, offset: i32) -> f32 {
        if offset == 0 {
            self.d[i / 16] * self.u[i] as f32 + self.m
        } else {
            self.d[i / 16] * (self.u[i] as i32 - offset) as f32
        }
    }
}

/// ggml's 6-bit scale and min `j` (0..8) of a Q4_K super-block's 12 packed bytes.
fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

impl BlockFormat {
    /// Weights per GGUF block: 32, or 256 for the K-quants' super-blocks. A matrix's columns
    /// must be a multiple of it.
    pub fn block_weights(self) -> usize {
        match self {
            BlockFormat::Q4K | BlockFormat::Q6K => 256,
            _ => BLOCK,
        }
    }

    fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_0 => 18,
            BlockFormat::Q4_1 => 20,
            BlockFormat::Q5_0 => 22,
            BlockFormat::Q8_0 => 34,
            BlockFormat::Q4K => 144,
            BlockFormat::Q6K => 210,
        }
    }

    /// Bits per weight in the packed panels: 4 (nibbles) or 8 (bytes; 5- and 6-bit quants too).
    fn bits(self) -> usize {
        match self {
            BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q4K => 4,
            BlockFormat::Q5_0 | BlockFormat::Q8_0 | BlockFormat::Q6K => 8,
        }
    }

    /// The integer offset of [`Block`]: nonzero for the two-scale blocks (Q6_K).
    fn offset(self) -> i32 {
        if self == BlockFormat::Q6K {
            Q6K_OFFSET
        } else {
            0
        }
    }

    /// One GGUF block (`block_bytes`) as its `block_weights / 32` blocks of 32, in order.
    fn decode(self, b: &[u8]) -> Vec<Block> {
        let mut u = [0u8; BLOCK];
        match self {
            BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
                let d = f16_at(b, 0);
                let (m, qs) = match self {
                    BlockFormat::Q4_0 => (-8.0 * d, &b[2..18]),
                    _ => (f16_at(b, 2), &b[4..20]),
                };
                for (j, &q) in qs.iter().enumerate() {
                    u[j] = q & 0x0F;
                    u[j + 16] = q >> 4;
                }
                vec![Block::affine(d, m, u)]
            }
            BlockFormat::Q5_0 => {
                // qh's bit j is weight j's fifth bit; qs holds weights j (low) and j + 16 (high).
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for (j, &q) in b[6..22].iter().enumerate() {
                    u[j] = (q & 0x0F) | (((qh >> j) & 1) << 4) as u8;
                    u[j + 16] = (q >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8;
                }
                vec![Block::affine(d, -16.0 * d, u)]
            }
            BlockFormat::Q8_0 => {
                let d = f16_at(b, 0);
                for (j, &q) in b[2..34].iter().enumerate() {
                    u[j] = (q as i8 as i16 + 128) as u8;
                }
                vec![Block::affine(d, -128.0 * d, u)]
            }
            BlockFormat::Q4K => {
                // d, dmin, 12 bytes of scales and mins, then 4 chunks of 32 bytes: chunk c's low
                // nibbles are sub-block 2c, its high nibbles sub-block 2c + 1.
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let (scales, qs) = (&b[4..16], &b[16..144]);
                (0..8)
                    .map(|j| {
                        let (sc, mn) = q4k_scale_min(j, scales);
                        let chunk = &qs[32 * (j / 2)..32 * (j / 2) + 32];
                        let u = std::array::from_fn(|i| if j % 2 == 0 { chunk[i] & 0x0F } else { chunk[i] >> 4 });
                        // ggml: `(d·sc)·u − dmin·mn`; adding the negated min is the same rounding.
                        Block::affine(d * sc as f32, -(dmin * mn as f32), u)
                    })
                    .collect()
            }
            BlockFormat::Q6K => {
                // ql (128 bytes), qh (64), 16 int8 scales, d. Per half of 128 weights (ql 64
                // bytes, qh 32): sub-block k (0..4) of 32 is weight l of ql[l + 32·(k % 2)]'s low
                // (k < 2) or high nibble and bits 2k..2k+2 of qh[l]; its halves of 16 take
                // scales 2j and 2j + 1 (j = 4·half + k).
                let (ql, qh, sc, d) = (&b[0..128], &b[128..192], &b[192..208], f16_at(b, 208));
                (0..8)
                    .map(|j| {
                        let (half, k) = (j / 4, j % 4);
                        let u = std::array::from_fn(|l| {
                            let lo = ql[64 * half + l + 32 * (k % 2)];
                            let lo = if k < 2 { lo & 0x0F } else { lo >> 4 };
                            lo | ((qh[32 * half + l] >> (2 * k)) & 3) << 4
                        });
                        let scale = |s: usize| d * sc[s] as i8 as f32;
                        Block { d: [scale(2 * j), scale(2 * j + 1)], m: 0.0, u }
                    })
                    .collect()
            }
        }
    }
}

/// The instruction sets the kernel has a version for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 F/BW and VNNI: `vpdpbusd`, a panel's 16 rows in one register.
    Avx512Vnni,
    /// AVX2 and FMA: `vpmaddubsw` + `vpmaddwd`, a panel in two halves of 8 rows.
    Avx2,
}

/// The best version this CPU runs (detected once): AVX-512 VNNI where the CPU has it, else AVX2
/// with FMA, else none (callers keep candle's quantized matmul). Packed weights run on it unless
/// the loader picked another (`PackedWeights::run_on`; `RuntimeConfig::cpu_qmatmul`).
pub fn isa() -> Option<Isa> {
    static ISA: std::sync::OnceLock<Option<Isa>> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| [Isa::Avx512Vnni, Isa::Avx2].into_iter().find(|&isa| cpu_has(isa)))
}

/// Whether this CPU has the instructions of `isa`.
pub fn cpu_has(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        match isa {
            Isa::Avx512Vnni => has!("avx512f") && has!("avx512bw") && has!("avx512vnni"),
            Isa::Avx2 => has!("avx2") && has!("fma"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        false
    }
}

/// Whether this CPU runs the kernel (see [`isa`]).
pub fn available() -> bool {
    isa().is_some()
}

/// A `[rows, cols]` weight matrix repacked for the kernel.
pub struct PackedWeights {
    rows: usize,
    cols: usize,
    bits: usize,
    /// Q6_K's integer offset (0 for the affine formats): blocks with two scales, one per 16
    /// weights (`d` for the first, `d2` for the second), and no `m`.
    offset: i32,
    /// Per panel, per block: `bits · 64` bytes (4 bits: chunk `c` holds groups `c` (low
    /// nibbles) and `c + 4` (high); 8 bits: chunk `g` holds group `g`). A chunk's byte
    /// `r·4 + j` is weight `4g + j` of the block in the panel's row `r`.
    qs: Vec<u8>,
    /// Per panel, per block: `d` of the panel's 16 rows.
    d: Vec<f32>,
    /// Per panel, per block: `m` of the panel's 16 rows (empty for Q6_K).
    m: Vec<f32>,
    /// Per panel, per block: the second half's `d` of the panel's 16 rows (Q6_K only).
    d2: Vec<f32>,
    /// The kernel version `matmul` runs: [`isa`] unless set by `run_on`; `None` on a CPU
    /// without one (only `matmul_reference` runs then).
    isa: Option<Isa>,
}

impl PackedWeights {
    /// Repacks GGUF blocks (`raw`: `rows × cols / block_weights` blocks, row-major). Rows past
    /// the last full panel are padded with zero weights.
    pub fn pack(format: BlockFormat, raw: &[u8], rows: usize, cols: usize) -> Result<Self, String> {
        let bw = format.block_weights();
        if cols % bw != 0 {
            return Err(format!("{cols} columns is not a multiple of {format:?}'s {bw}-weight block"));
        }
        let nb = cols / BLOCK;
        let bb = format.block_bytes();
        if raw.len() != rows * (cols / bw) * bb {
            let expected = rows * (cols / bw) * bb;
            return Err(format!("{} bytes for a {rows}×{cols} {format:?} matrix, expected {expected}", raw.len()));
        }
        let (bits, offset) = (format.bits(), format.offset());
        let block_bytes = panel_block_bytes(bits);
        let panels = rows.div_ceil(PANEL);
        let scales = panels * nb * PANEL;
        let mut qs = vec![0u8; panels * nb * block_bytes];
        let mut d = vec![0f32; scales];
        let mut m = vec![0f32; if offset == 0 { scales } else { 0 }];
        let mut d2 = vec![0f32; if offset == 0 { 0 } else { scales }];
        for row in 0..rows {
            let (p, r) = (row / PANEL, row % PANEL);
            let blocks = raw[row * (cols / bw) * bb..(row + 1) * (cols / bw) * bb].chunks_exact(bb);
            for (b, blk) in blocks.flat_map(|src| format.decode(src)).enumerate() {
                let (pb, u) = (p * nb + b, blk.u);
                d[pb * PANEL + r] = blk.d[0];
                if offset == 0 {
                    m[pb * PANEL + r] = blk.m;
                } else {
                    d2[pb * PANEL + r] = blk.d[1];
                }
                let dst = &mut qs[pb * block_bytes..(pb + 1) * block_bytes];
                for g in 0..BLOCK / 4 {
                    for j in 0..4 {
                        let v = u[4 * g + j];
                        if bits == 8 {
                            dst[g * 64 + r * 4 + j] = v;
                        } else if g < 4 {
                            dst[g * 64 + r * 4 + j] |= v;
                        } else {
                            dst[(g - 4) * 64 + r * 4 + j] |= v << 4;
                        }
                    }
                }
            }
        }
        Ok(Self { rows, cols, bits, offset, qs, d, m, d2, isa: isa() })
    }

    /// The same weights run by the `isa` version of the kernel (chosen at load, so that one
    /// model's layers all run the same arithmetic).
    pub fn run_on(self, isa: Isa) -> Self {
        assert!(cpu_has(isa), "this CPU cannot run the {isa:?} kernel");
        Self { isa: Some(isa), ..self }
    }

    /// The kernel version `matmul` runs.
    pub fn isa(&self) -> Option<Isa> {
        self.isa
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    fn panel_bytes(&self) -> usize {
        (self.cols / BLOCK) * panel_block_bytes(self.bits)
    }

    /// `x`: `[n, cols]` row-major; returns `[n, rows]`. Panels are shared out over candle's CPU
    /// thread pool (the one its own quantized matmuls use).
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        Self::matmul_group(&[self], x, n).pop().unwrap_or_default()
    }

    /// Several matrices over the same input (a layer's q, k, v; gate and up): the activations
    /// quantized once and every matrix's panels in one pass of the thread pool. Each output is
    /// bit for bit what `matmul` gives. All run the first matrix's kernel version.
    pub fn matmul_group(ws: &[&PackedWeights], x: &[f32], n: usize) -> Vec<Vec<f32>> {
        let Some(first) = ws.first() else { return Vec::new() };
        let isa = first.isa.expect("weights are packed only where a kernel runs");
        Self::matmul_group_on(isa, ws, x, n)
    }

    /// `matmul` with a given version of the kernel (tests run every version the CPU has).
    pub fn matmul_on(&self, isa: Isa, x: &[f32], n: usize) -> Vec<f32> {
        Self::matmul_group_on(isa, &[self], x, n).pop().unwrap_or_default()
    }

    fn matmul_group_on(isa: Isa, ws: &[&PackedWeights], x: &[f32], n: usize) -> Vec<Vec<f32>> {
        assert!(cpu_has(isa), "this CPU cannot run the {isa:?} kernel");
        let Some(cols) = ws.first().map(|w| w.cols) else { return Vec::new() };
        assert!(ws.iter().all(|w| w.cols == cols), "matrices of a group take the same input");
        assert_eq!(x.len(), n * cols, "activations are not [n, cols]");
        let xq = QuantizedRows::new(x, n, cols);
        let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; n * w.rows]).collect();
        let ptrs: Vec<SharedOut> = outs.iter_mut().map(|o| SharedOut(o.as_mut_ptr())).collect();
        // Panel g of the group is panel g − first[m] of matrix m.
        let mut first = Vec::with_capacity(ws.len() + 1);
        let mut total = 0;
        for w in ws {
            first.push(total);
            total += w.rows.div_ceil(PANEL);
        }
        first.push(total);
        let run = |range: std::ops::Range<usize>| {
            let mut m = 0;
            for g in range {
                while g >= first[m + 1] {
                    m += 1;
                }
                // SAFETY: panel `p` writes only columns `16p..16p+16` of each row of output `m`.
                unsafe { ws[m].panel(isa, g - first[m], &xq, ptrs[m].0) };
            }
        };
        // One decode row of a small matrix is a few microseconds: not worth a pool wake-up.
        let work: usize = ws.iter().map(|w| n * w.rows * cols).sum();
        if work < SERIAL_WORK {
            run(0..total);
        } else {
            candle_core::utils::barrier_pool().execute_chunked(total, run);
        }
        drop(ptrs);
        outs
    }

    /// Panel `p` for every activation row, `TILE` rows at a time.
    unsafe fn panel(&self, isa: Isa, p: usize, xq: &QuantizedRows, out: *mut f32) {
        let nb = self.cols / BLOCK;
        let valid = (self.rows - p * PANEL).min(PANEL);
        let args = PanelArgs {
            qs: self.qs.as_ptr().add(p * self.panel_bytes()),
            d: self.d.as_ptr().add(p * nb * PANEL),
            // The one of `m` and `d2` that a format has.
            m: if self.offset == 0 { self.m.as_ptr() } else { self.d2.as_ptr() }.add(p * nb * PANEL),
            offset: self.offset,
            nb,
            out_stride: self.rows,
            valid,
        };
        let mut row = 0;
        while row < xq.n {
            let t = (xq.n - row).min(TILE);
            let o = out.add(row * self.rows + p * PANEL);
            #[cfg(target_arch = "x86_64")]
            match (isa, self.bits, self.offset != 0, t) {
                (Isa::Avx512Vnni, 4, _, TILE) => avx512::panel::<4, TILE, false>(&args, xq, row, o),
                (Isa::Avx512Vnni, 4, _, _) => avx512::panel::<4, 1, false>(&args, xq, row, o),
                (Isa::Avx512Vnni, _, false, TILE) => avx512::panel::<8, TILE, false>(&args, xq, row, o),
                (Isa::Avx512Vnni, _, false, _) => avx512::panel::<8, 1, false>(&args, xq, row, o),
                (Isa::Avx512Vnni, _, true, TILE) => avx512::panel::<8, TILE, true>(&args, xq, row, o),
                (Isa::Avx512Vnni, _, true, _) => avx512::panel::<8, 1, true>(&args, xq, row, o),
                (Isa::Avx2, 4, _, TILE) => avx2::panel::<4, TILE, false>(&args, xq, row, o),
                (Isa::Avx2, 4, _, _) => avx2::panel::<4, 1, false>(&args, xq, row, o),
                (Isa::Avx2, _, false, TILE) => avx2::panel::<8, TILE, false>(&args, xq, row, o),
                (Isa::Avx2, _, false, _) => avx2::panel::<8, 1, false>(&args, xq, row, o),
                (Isa::Avx2, _, true, TILE) => avx2::panel::<8, TILE, true>(&args, xq, row, o),
                (Isa::Avx2, _, true, _) => avx2::panel::<8, 1, true>(&args, xq, row, o),
            }
            row += if t == TILE { TILE } else { 1 };
        }
    }

    /// The same product in plain scalar code, operation for operation the kernel's arithmetic
    /// order (per block: `acc += (d·dx)·dot + m·sx`; Q6_K per half of 16:
    /// `acc += (d·dx)·(dot − 32·Σq)`); for tests.
    pub fn matmul_reference(&self, x: &[f32], n: usize) -> Vec<f32> {
        let xq = QuantizedRows::new(x, n, self.cols);
        let nb = self.cols / BLOCK;
        let mut out = vec![0f32; n * self.rows];
        for i in 0..n {
            for row in 0..self.rows {
                let (p, r) = (row / PANEL, row % PANEL);
                let mut acc = 0f32;
                for b in 0..nb {
                    let pb = p * nb + b;
                    let blk = &self.qs[pb * panel_block_bytes(self.bits)..];
                    let mut dot = [0i32; 2];
                    for e in 0..BLOCK {
                        let (g, j) = (e / 4, e % 4);
                        let u = if self.bits == 8 {
                            blk[g * 64 + r * 4 + j]
                        } else if g < 4 {
                            blk[g * 64 + r * 4 + j] & 0x0F
                        } else {
                            blk[(g - 4) * 64 + r * 4 + j] >> 4
                        };
                        dot[e / 16] += u as i32 * xq.q[i * self.cols + b * BLOCK + e] as i32;
                    }
                    let (s, dx) = (pb * PANEL + r, xq.dx[i * nb + b]);
                    if self.offset == 0 {
                        acc = ((dot[0] + dot[1]) as f32).mul_add(self.d[s] * dx, acc);
                        acc = self.m[s].mul_add(xq.sx[i * nb + b], acc);
                    } else {
                        for (h, (dot, d)) in dot.into_iter().zip([self.d[s], self.d2[s]]).enumerate() {
                            let centred = dot - self.offset * xq.hsum[(i * nb + b) * 2 + h];
                            acc = (centred as f32).mul_add(d * dx, acc);
                        }
                    }
                }
                out[i * self.rows + row] = acc;
            }
        }
        out
    }
}

/// Bytes of one block of a panel: 16 rows × 32 weights of `bits` bits (4 or 8 chunks of 64).
fn panel_block_bytes(bits: usize) -> usize {
    PANEL * BLOCK * bits / 8
}

/// Work (`n·rows·cols`) below which a matmul runs on the calling thread.
const SERIAL_WORK: usize = 1 << 18;

struct SharedOut(*mut f32);
// SAFETY: the panels written through it are disjoint (see `matmul`).
unsafe impl Sync for SharedOut {}
unsafe impl Send for SharedOut {}

/// Activations quantized per block of 32 to int8: `x ≈ dx·q`, and `sx = dx·Σq` per block;
/// `hsum`: `Σq` of each half of 16 (Q6_K's offset term).
struct QuantizedRows {
    n: usize,
    cols: usize,
    q: Vec<i8>,
    dx: Vec<f32>,
    sx: Vec<f32>,
    hsum: Vec<i32>,
}

impl QuantizedRows {
    fn new(x: &[f32], n: usize, cols: usize) -> Self {
        let nb = cols / BLOCK;
        let mut q = vec![0i8; n * cols];
        let mut dx = vec![0f32; n * nb];
        let mut sx = vec![0f32; n * nb];
        let mut hsum = vec![0i32; n * nb * 2];
        for (bi, (xb, qb)) in x.chunks_exact(BLOCK).zip(q.chunks_exact_mut(BLOCK)).enumerate() {
            // Written lane by lane so the loops vectorise: a max over 16 lanes, then rounding
            // half to even (`vroundps`; `f32::round` is a libm call per element).
            let mut lanes = [0f32; 16];
            for half in xb.chunks_exact(16) {
                for (l, v) in lanes.iter_mut().zip(half) {
                    *l = l.max(v.abs());
                }
            }
            let amax = lanes.iter().fold(0f32, |a, &v| a.max(v));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            for (h, (xh, qh)) in xb.chunks_exact(16).zip(qb.chunks_exact_mut(16)).enumerate() {
                let mut sum = 0i32;
                for (v, qv) in xh.iter().zip(qh.iter_mut()) {
                    let r = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
                    *qv = r;
                    sum += r as i32;
                }
                hsum[bi * 2 + h] = sum;
            }
            dx[bi] = d;
            sx[bi] = d * (hsum[bi * 2] + hsum[bi * 2 + 1]) as f32;
        }
        Self { n, cols, q, dx, sx, hsum }
    }
}

/// A panel's pointers into `PackedWeights` (`m` points at `d2` where `offset` is not 0).
struct PanelArgs {
    qs: *const u8,
    d: *const f32,
    m: *const f32,
    offset: i32,
    nb: usize,
    out_stride: usize,
    valid: usize,
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{PanelArgs, QuantizedRows, BLOCK, PANEL};
    use std::arch::x86_64::*;

    /// `T` activation rows from `row` against one panel; `BITS` 4 or 8; `SPLIT`: two scales
    /// per block (Q6_K, `a.offset`). Writes the panel's `valid` output columns of each row at
    /// `out + t·out_stride`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn panel<const BITS: usize, const T: usize, const SPLIT: bool>(
        a: &PanelArgs,
        xq: &QuantizedRows,
        row: usize,
        out: *mut f32,
    ) {
        let low = _mm512_set1_epi8(0x0F);
        let nb = a.nb;
        let mut acc = [_mm512_setzero_ps(); T];
        for b in 0..nb {
            let mut w = [_mm512_setzero_si512(); 8];
            if BITS == 4 {
                let base = a.qs.add(b * 256);
                for c in 0..4 {
                    let v = _mm512_loadu_si512(base.add(c * 64) as *const __m512i);
                    w[c] = _mm512_and_si512(v, low);
                    w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
            } else {
                let base = a.qs.add(b * 512);
                for (g, wg) in w.iter_mut().enumerate() {
                    *wg = _mm512_loadu_si512(base.add(g * 64) as *const __m512i);
                }
            }
            let dw = _mm512_loadu_ps(a.d.add(b * PANEL));
            let mw = _mm512_loadu_ps(a.m.add(b * PANEL));
            for (t, acc_t) in acc.iter_mut().enumerate() {
                let i = row + t;
                let xb = xq.q.as_ptr().add(i * xq.cols + b * BLOCK) as *const i32;
                // Two independent chains halve the dependency on vpdpbusd's latency; they are
                // also the block's two halves of 16 weights.
                let mut s0 = _mm512_setzero_si512();
                let mut s1 = _mm512_setzero_si512();
                for g in 0..4 {
                    s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(xb.add(g).read_unaligned()));
                    s1 = _mm512_dpbusd_epi32(s1, w[g + 4], _mm512_set1_epi32(xb.add(g + 4).read_unaligned()));
                }
                let nbi = i * nb + b;
                let dx = _mm512_set1_ps(*xq.dx.get_unchecked(nbi));
                if SPLIT {
                    // mw holds the second half's scales: Σ (u − offset)·q per half, exact in i32.
                    let h = xq.hsum.as_ptr().add(nbi * 2);
                    let c0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(a.offset * *h));
                    let c1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(a.offset * *h.add(1)));
                    *acc_t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c0), _mm512_mul_ps(dw, dx), *acc_t);
                    *acc_t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1), _mm512_mul_ps(mw, dx), *acc_t);
                } else {
                    let s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                    *acc_t = _mm512_fmadd_ps(s, _mm512_mul_ps(dw, dx), *acc_t);
                    *acc_t = _mm512_fmadd_ps(mw, _mm512_set1_ps(*xq.sx.get_unchecked(nbi)), *acc_t);
                }
            }
        }
        let mask: __mmask16 = if a.valid >= 16 { 0xFFFF } else { (1u16 << a.valid) - 1 };
        for (t, acc_t) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(t * a.out_stride), mask, *acc_t);
        }
    }
}

/// The same kernel for CPUs with AVX2 and FMA but no AVX-512 (most laptops, and machines like
/// this project's CI): `vpmaddubsw` (u8·i8 pairs into i16) then `vpmaddwd` with ones (into
/// i32) stand in for `vpdpbusd`, and a panel's 16 rows are two halves of 8 lanes. Exact like
/// the AVX-512 kernel: a 4-bit weight times an int8 activation is at most 15·127, so the eight
/// groups of a block sum in i16 without overflow (8·2·1,905 < 32,767) before one widening; an
/// 8-bit weight is split into its two nibbles (`u = 16·hi + lo`), each summed that way. The
/// float steps are the reference's, in its order, so the output is bit for bit the same.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{PanelArgs, QuantizedRows, BLOCK, PANEL};
    use std::arch::x86_64::*;

    /// `T` activation rows from `row` against one panel; `BITS` 4 or 8; `SPLIT` (8 bits only):
    /// two scales per block, as in the AVX-512 kernel.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn panel<const BITS: usize, const T: usize, const SPLIT: bool>(
        a: &PanelArgs,
        xq: &QuantizedRows,
        row: usize,
        out: *mut f32,
    ) {
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let nb = a.nb;
        for half in 0..2 {
            if a.valid <= half * 8 {
                break;
            }
            let mut acc = [_mm256_setzero_ps(); T];
            for b in 0..nb {
                // Group g's 4 bytes for the half's 8 rows: low nibbles (or, for 8 bits, the
                // low nibbles of the bytes) in `lo[g]`, high ones in `hi[g]`.
                let mut lo = [_mm256_setzero_si256(); 8];
                let mut hi = [_mm256_setzero_si256(); 8];
                if BITS == 4 {
                    let base = a.qs.add(b * 256 + half * 32);
                    for c in 0..4 {
                        let v = _mm256_loadu_si256(base.add(c * 64) as *const __m256i);
                        lo[c] = _mm256_and_si256(v, low);
                        lo[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    }
                } else {
                    let base = a.qs.add(b * 512 + half * 32);
                    for g in 0..8 {
                        let v = _mm256_loadu_si256(base.add(g * 64) as *const __m256i);
                        lo[g] = _mm256_and_si256(v, low);
                        hi[g] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    }
                }
                let dw = _mm256_loadu_ps(a.d.add(b * PANEL + half * 8));
                let mw = _mm256_loadu_ps(a.m.add(b * PANEL + half * 8));
                for (t, acc_t) in acc.iter_mut().enumerate() {
                    let i = row + t;
                    let xb = xq.q.as_ptr().add(i * xq.cols + b * BLOCK) as *const i32;
                    // Per half of 16 weights where SPLIT, else all in the first.
                    let mut s_lo = [_mm256_setzero_si256(); 2];
                    let mut s_hi = [_mm256_setzero_si256(); 2];
                    for g in 0..8 {
                        let h = if SPLIT { g / 4 } else { 0 };
                        let x4 = _mm256_set1_epi32(xb.add(g).read_unaligned());
                        s_lo[h] = _mm256_add_epi16(s_lo[h], _mm256_maddubs_epi16(lo[g], x4));
                        if BITS == 8 {
                            s_hi[h] = _mm256_add_epi16(s_hi[h], _mm256_maddubs_epi16(hi[g], x4));
                        }
                    }
                    let dot = |h: usize| {
                        let dot = _mm256_madd_epi16(s_lo[h], ones);
                        if BITS == 8 {
                            _mm256_add_epi32(dot, _mm256_slli_epi32(_mm256_madd_epi16(s_hi[h], ones), 4))
                        } else {
                            dot
                        }
                    };
                    let nbi = i * nb + b;
                    let dx = _mm256_set1_ps(*xq.dx.get_unchecked(nbi));
                    if SPLIT {
                        let hs = xq.hsum.as_ptr().add(nbi * 2);
                        let c0 = _mm256_sub_epi32(dot(0), _mm256_set1_epi32(a.offset * *hs));
                        let c1 = _mm256_sub_epi32(dot(1), _mm256_set1_epi32(a.offset * *hs.add(1)));
                        *acc_t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c0), _mm256_mul_ps(dw, dx), *acc_t);
                        *acc_t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1), _mm256_mul_ps(mw, dx), *acc_t);
                    } else {
                        let s = _mm256_cvtepi32_ps(dot(0));
                        *acc_t = _mm256_fmadd_ps(s, _mm256_mul_ps(dw, dx), *acc_t);
                        *acc_t = _mm256_fmadd_ps(mw, _mm256_set1_ps(*xq.sx.get_unchecked(nbi)), *acc_t);
                    }
                }
            }
            let valid = a.valid.saturating_sub(half * 8).min(8);
            for (t, acc_t) in acc.iter().enumerate() {
                let dst = out.add(t * a.out_stride + half * 8);
                if valid == 8 {
                    _mm256_storeu_ps(dst, *acc_t);
                } else {
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), *acc_t);
                    std::ptr::copy_nonoverlapping(lanes.as_ptr(), dst, valid);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};

    const FORMATS: [BlockFormat; 6] = [
        BlockFormat::Q4_1,
        BlockFormat::Q4_0,
        BlockFormat::Q5_0,
        BlockFormat::Q8_0,
        BlockFormat::Q4K,
        BlockFormat::Q6K,
    ];

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        *seed >> 33
    }

    fn ggml_dtype(format: BlockFormat) -> GgmlDType {
        match format {
            BlockFormat::Q4_0 => GgmlDType::Q4_0,
            BlockFormat::Q4_1 => GgmlDType::Q4_1,
            BlockFormat::Q5_0 => GgmlDType::Q5_0,
            BlockFormat::Q8_0 => GgmlDType::Q8_0,
            BlockFormat::Q4K => GgmlDType::Q4K,
            BlockFormat::Q6K => GgmlDType::Q6K,
        }
    }

    /// Random blocks of `format`: random quants, scales and (K-quant) sub-block scales, with the
    /// f16 scales set so weights come out around ±0.5 (mins and offsets either sign).
    fn random_blocks(format: BlockFormat, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
        let bb = format.block_bytes();
        let mut raw: Vec<u8> = (0..rows * cols / format.block_weights() * bb).map(|_| lcg(seed) as u8).collect();
        // (byte offset, base, spread) of each f16 field.
        let fields: &[(usize, f32, f32)] = match format {
            BlockFormat::Q4_1 => &[(0, 0.01, 0.04), (2, -0.1, 0.2)],
            BlockFormat::Q4K => &[(0, 0.0002, 0.001), (2, 0.0002, 0.001)],
            BlockFormat::Q6K => &[(208, 0.0001, 0.0002)],
            _ => &[(0, 0.01, 0.04)],
        };
        for blk in raw.chunks_exact_mut(bb) {
            for &(at, base, spread) in fields {
                let v = f16::from_f32(base + (lcg(seed) % 1000) as f32 * spread / 1000.0);
                blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        raw
    }

    /// Our decoding of every block, as floats.
    fn dequantize(format: BlockFormat, raw: &[u8]) -> Vec<f32> {
        let blocks = raw.chunks_exact(format.block_bytes()).flat_map(|b| format.decode(b));
        blocks.flat_map(|b| (0..BLOCK).map(move |i| b.weight(i, format.offset()))).collect()
    }

    /// candle's dequantization of the same bytes (ggml's reference code).
    fn candle_dequantize(format: BlockFormat, raw: &[u8], rows: usize, cols: usize) -> Vec<f32> {
        let cpu = candle_core::Device::Cpu;
        let q = qtensor_from_ggml(ggml_dtype(format), raw, vec![rows, cols], &cpu).unwrap();
        q.dequantize(&cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Columns for a test matrix of `format`: `blocks` of 32, at least one GGUF block.
    fn test_cols(format: BlockFormat, blocks: usize) -> usize {
        (blocks * BLOCK).max(format.block_weights())
    }

    #[test]
    fn block_formats_decode_like_ggml() {
        // Q8_0: d·q; Q4_0: d·(nibble − 8); Q4_1: d·nibble + m.
        let d = f16::from_f32(0.5).to_le_bytes();
        let mut q8 = d.to_vec();
        q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
        assert_eq!(BlockFormat::Q8_0.decode(&q8)[0].weight(3, 0), 0.5 * (3.0 - 16.0));
        let mut q4 = d.to_vec();
        q4.extend((0..16).map(|i| (i as u8) | (15 - i as u8) << 4));
        let b = BlockFormat::Q4_0.decode(&q4)[0];
        assert_eq!(b.weight(2, 0), 0.5 * (2.0 - 8.0));
        assert_eq!(b.weight(18, 0), 0.5 * (13.0 - 8.0));
        let mut q41 = d.to_vec();
        q41.extend(f16::from_f32(-1.0).to_le_bytes());
        q41.extend((0..16).map(|i| (i as u8) | (15 - i as u8) << 4));
        assert_eq!(BlockFormat::Q4_1.decode(&q41)[0].weight(17, 0), 0.5 * 14.0 - 1.0);
        // Q5_0: the fifth bit of weight j is bit j of qh; d·(q − 16).
        let mut q5 = d.to_vec();
        q5.extend(0x8000_0001u32.to_le_bytes());
        q5.extend((0..16).map(|i| (i as u8) | (15 - i as u8) << 4));
        let b = BlockFormat::Q5_0.decode(&q5)[0];
        assert_eq!((b.weight(0, 0), b.weight(1, 0)), (0.5 * (16.0 - 16.0), 0.5 * (1.0 - 16.0)));
        assert_eq!(b.weight(31, 0), 0.5 * (16.0 + 0.0 - 16.0));
    }

    #[test]
    fn decoding_equals_candles_dequantization() {
        let mut seed = 3;
        for format in FORMATS {
            let (rows, cols) = (3, 512);
            let raw = random_blocks(format, rows, cols, &mut seed);
            let ours = dequantize(format, &raw);
            let theirs = candle_dequantize(format, &raw, rows, cols);
            assert_eq!(ours.len(), theirs.len());
            for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                assert!(a == b, "{format:?} weight {i}: {a} decoded, candle {b}");
            }
        }
    }

    #[test]
    fn kernel_matches_reference_and_dequantized_product() {
        let mut seed = 7;
        for format in FORMATS {
            // 45 rows: two full panels and a partial one (both halves of 8 rows in use, the
            // second partly); 5 activation rows: a tile and one more.
            let (rows, cols, n) = (45, test_cols(format, 3), 5);
            let raw = random_blocks(format, rows, cols, &mut seed);
            let packed = PackedWeights::pack(format, &raw, rows, cols).unwrap();
            let x: Vec<f32> = (0..n * cols).map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0).collect();
            let reference = packed.matmul_reference(&x, n);
            // Against the float product of candle's dequantized weights: the only error is the
            // activations' int8 rounding.
            let w = candle_dequantize(format, &raw, rows, cols);
            for i in 0..n {
                for r in 0..rows {
                    let exact: f32 = (0..cols).map(|c| x[i * cols + c] * w[r * cols + c]).sum();
                    let norm: f32 = (0..cols).map(|c| (x[i * cols + c] * w[r * cols + c]).abs()).sum();
                    let got = reference[i * rows + r];
                    assert!((got - exact).abs() <= 0.01 * norm + 1e-5, "{format:?} [{i},{r}]: {got} vs {exact}");
                }
            }
            for isa in [Isa::Avx512Vnni, Isa::Avx2].into_iter().filter(|&i| cpu_has(i)) {
                let fast = packed.matmul_on(isa, &x, n);
                assert_eq!(fast, reference, "{format:?}: the {isa:?} kernel differs from its scalar reference");
            }
        }
    }

    #[test]
    fn a_group_gives_each_matrix_its_own_product() {
        if !available() {
            return;
        }
        let mut seed = 5;
        let cols = 256;
        let shapes = [
            (40, BlockFormat::Q4_1),
            (16, BlockFormat::Q8_0),
            (33, BlockFormat::Q4_0),
            (20, BlockFormat::Q6K),
            (17, BlockFormat::Q4K),
            (24, BlockFormat::Q5_0),
        ];
        let packed: Vec<PackedWeights> = shapes
            .iter()
            .map(|&(rows, f)| PackedWeights::pack(f, &random_blocks(f, rows, cols, &mut seed), rows, cols).unwrap())
            .collect();
        let x: Vec<f32> = (0..6 * cols).map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0).collect();
        let group = PackedWeights::matmul_group(&packed.iter().collect::<Vec<_>>(), &x, 6);
        for (w, got) in packed.iter().zip(&group) {
            assert_eq!(*got, w.matmul(&x, 6));
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_alone_or_in_any_batch() {
        if !available() {
            return;
        }
        let mut seed = 11;
        for format in FORMATS {
            let (rows, cols) = (48, test_cols(format, 2));
            let raw = random_blocks(format, rows, cols, &mut seed);
            let packed = PackedWeights::pack(format, &raw, rows, cols).unwrap();
            let x: Vec<f32> = (0..9 * cols).map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0).collect();
            for isa in [Isa::Avx512Vnni, Isa::Avx2].into_iter().filter(|&i| cpu_has(i)) {
                let batch = packed.matmul_on(isa, &x, 9);
                for i in 0..9 {
                    let alone = packed.matmul_on(isa, &x[i * cols..(i + 1) * cols], 1);
                    assert_eq!(alone, batch[i * rows..(i + 1) * rows], "{format:?}, {isa:?}, row {i}");
                }
            }
        }
    }
}
