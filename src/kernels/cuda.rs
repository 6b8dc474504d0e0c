//! Launch glue for the kernels in `kernels/` (PTX compiled by build.rs, loaded once per device
//! through candle's module cache). Inputs must be contiguous (the ops make them so); a start
//! offset is honoured.

use super::gated_memory::GmDims;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaStorage, DType, Layout, Result};

const GATED_MEMORY_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gated_memory.ptx"));
const MASKED_SOFTMAX_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/masked_softmax.ptx"));

const THREADS: u32 = 256;
/// Shared memory per block without opting in to more.
const SHARED_FLOATS: usize = 48 * 1024 / 4;

fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = l.contiguous_offsets() else { bail!("{what}: expected a contiguous input, got {l:?}") };
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}

/// One op input as candle hands it to a custom op: the storage and its layout.
#[derive(Clone, Copy)]
pub struct CudaInput<'a> {
    pub storage: &'a CudaStorage,
    pub layout: &'a Layout,
}

impl<'a> CudaInput<'a> {
    pub fn of(storage: &'a CudaStorage, layout: &'a Layout) -> Self {
        Self { storage, layout }
    }

    fn view<T: CudaDType>(&self, what: &str) -> Result<CudaView<'a, T>> {
        view(self.storage, self.layout, what)
    }
}

/// `GmParams` in kernels/gated_memory.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct GmParams {
    d: i32,
    s: i32,
    heads: i32,
    t: i32,
    off: [i64; 7],
}
unsafe impl DeviceRepr for GmParams {}

fn gm_params(dims: GmDims, t: usize) -> GmParams {
    GmParams { d: dims.d as i32, s: dims.s as i32, heads: dims.heads as i32, t: t as i32, off: dims.offsets().0 }
}

/// Rows per block: as many (≤ 16) as fit the per-row shared floats in 48 KB.
fn tile_rows(floats_per_row: usize) -> usize {
    (SHARED_FLOATS / floats_per_row).clamp(1, 16)
}

fn gm_launch(dims: GmDims, b: usize, t: usize, floats_per_row: usize) -> (LaunchConfig, i32) {
    let tr = tile_rows(floats_per_row);
    let cfg = LaunchConfig {
        grid_dim: (t.div_ceil(tr) as u32, (b * dims.heads) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: (tr * floats_per_row * 4) as u32,
    };
    (cfg, tr as i32)
}

/// The mixed output for `q`, `attn` (`[b, heads, t, d]`) and the packed `params`.
pub fn gated_memory_fwd(q: CudaInput, attn: CudaInput, params: CudaInput, dims: GmDims) -> Result<CudaStorage> {
    let (b, _, t, _) = q.layout.shape().dims4()?;
    let dev = q.storage.device().clone();
    let n = q.layout.shape().elem_count();
    let (q, a, p) = (q.view::<f32>("gm q")?, attn.view::<f32>("gm attn")?, params.view::<f32>("gm p")?);
    let out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(n)? };
    let (cfg, tr) = gm_launch(dims, b, t, 3 * dims.d + dims.s + 1);
    let params = gm_params(dims, t);
    let func = dev.get_or_load_custom_func("gated_memory_fwd", "lift_gated_memory", GATED_MEMORY_PTX)?;
    let mut builder = func.builder();
    builder.arg(&q);
    builder.arg(&a);
    builder.arg(&p);
    builder.arg(&out);
    builder.arg(&params);
    builder.arg(&tr);
    unsafe { builder.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `[dq | dattn | dp]` for the output gradient `grad`, and its length.
pub fn gated_memory_bwd(
    q: CudaInput,
    attn: CudaInput,
    params: CudaInput,
    grad: CudaInput,
    dims: GmDims,
) -> Result<(CudaStorage, usize)> {
    let (b, _, t, _) = q.layout.shape().dims4()?;
    let dev = q.storage.device().clone();
    let n = q.layout.shape().elem_count();
    let len = 2 * n + params.layout.shape().elem_count();
    let q = q.view::<f32>("gm q")?;
    let a = attn.view::<f32>("gm attn")?;
    let p = params.view::<f32>("gm p")?;
    let g = grad.view::<f32>("gm grad")?;
    let grads: CudaSlice<f32> = dev.alloc_zeros::<f32>(len)?;
    let (cfg, tr) = gm_launch(dims, b, t, 7 * dims.d + 2 * dims.s + 2);
    let params = gm_params(dims, t);
    let n = n as i64;
    let func = dev.get_or_load_custom_func("gated_memory_bwd", "lift_gated_memory", GATED_MEMORY_PTX)?;
    let mut builder = func.builder();
    builder.arg(&q);
    builder.arg(&a);
    builder.arg(&p);
    builder.arg(&g);
    builder.arg(&grads);
    builder.arg(&n);
    builder.arg(&params);
    builder.arg(&tr);
    unsafe { builder.launch(cfg) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(grads, dev), len))
}

fn row_launch(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

pub fn masked_softmax_fwd(
    s: &CudaStorage,
    l: &Layout,
    bias: Option<(&CudaStorage, &Layout)>,
    scale: f32,
) -> Result<CudaStorage> {
    match s.dtype() {
        DType::F32 => launch_ms_fwd::<f32>(s, l, bias, scale),
        DType::BF16 => launch_ms_fwd::<half::bf16>(s, l, bias, scale),
        other => bail!("masked-softmax: unsupported dtype {other:?}"),
    }
}

pub fn masked_softmax_bwd(p: &CudaStorage, pl: &Layout, g: &CudaStorage, gl: &Layout) -> Result<CudaStorage> {
    match p.dtype() {
        DType::F32 => launch_ms_bwd::<f32>(p, pl, g, gl),
        DType::BF16 => launch_ms_bwd::<half::bf16>(p, pl, g, gl),
        other => bail!("masked-softmax-bwd: unsupported dtype {other:?}"),
    }
}

/// Kernel name for T (`masked_softmax_{fwd|bwd}_{f32|bf16}`), after checking that every other
/// input has T's dtype too.
fn ms_kernel<T: candle_core::WithDType>(kind: &str, others: &[&CudaStorage]) -> Result<String> {
    for o in others {
        if o.dtype() != T::DTYPE {
            bail!("masked-softmax: input dtype {:?} differs from {:?}", o.dtype(), T::DTYPE);
        }
    }
    let suffix = if T::DTYPE == DType::F32 { "f32" } else { "bf16" };
    Ok(format!("masked_softmax_{kind}_{suffix}"))
}

fn launch_ms_fwd<T: CudaDType + DeviceRepr + candle_core::WithDType>(
    s: &CudaStorage,
    l: &Layout,
    bias: Option<(&CudaStorage, &Layout)>,
    scale: f32,
) -> Result<CudaStorage> {
    let name = ms_kernel::<T>("fwd", &bias.iter().map(|(b, _)| *b).collect::<Vec<_>>())?;
    let (_, h, tq, tk) = l.shape().dims4()?;
    let rows = l.shape().elem_count() / tk.max(1);
    let dev = s.device().clone();
    let sv = view::<T>(s, l, "masked-softmax scores")?;
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(l.shape().elem_count())? };
    let (h, tq, tk) = (h as i32, tq as i32, tk as i32);
    // The bias is read through its strides (0 on broadcast dims), from its start offset.
    let mut strides = [0i64; 4];
    let bias_view = match bias {
        Some((bs, bl)) => {
            for (o, st) in strides.iter_mut().zip(bl.stride()) {
                *o = *st as i64;
            }
            Some(bs.as_cuda_slice::<T>()?.slice(bl.start_offset()..))
        }
        None => None,
    };
    let null = 0u64;
    let func = dev.get_or_load_custom_func(&name, "lift_masked_softmax", MASKED_SOFTMAX_PTX)?;
    let mut builder = func.builder();
    builder.arg(&sv);
    match &bias_view {
        Some(v) => builder.arg(v),
        None => builder.arg(&null),
    };
    for st in &strides {
        builder.arg(st);
    }
    builder.arg(&out);
    builder.arg(&h);
    builder.arg(&tq);
    builder.arg(&tk);
    builder.arg(&scale);
    unsafe { builder.launch(row_launch(rows)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

fn launch_ms_bwd<T: CudaDType + DeviceRepr + candle_core::WithDType>(
    p: &CudaStorage,
    pl: &Layout,
    g: &CudaStorage,
    gl: &Layout,
) -> Result<CudaStorage> {
    let name = ms_kernel::<T>("bwd", &[g])?;
    let dev = p.device().clone();
    let tk = pl.dims().last().copied().unwrap_or(1);
    let rows = pl.shape().elem_count() / tk.max(1);
    let pv = view::<T>(p, pl, "masked-softmax P")?;
    let gv = view::<T>(g, gl, "masked-softmax dP")?;
    let out: CudaSlice<T> = unsafe { dev.alloc::<T>(pl.shape().elem_count())? };
    let tk = tk as i32;
    let func = dev.get_or_load_custom_func(&name, "lift_masked_softmax", MASKED_SOFTMAX_PTX)?;
    let mut builder = func.builder();
    builder.arg(&pv);
    builder.arg(&gv);
    builder.arg(&out);
    builder.arg(&tk);
    unsafe { builder.launch(row_launch(rows)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
