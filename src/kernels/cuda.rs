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

const DECODE_ATTENTION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/decode_attention.ptx"));

/// A view of a (read-locked) tensor storage, for the launches below that take tensors rather
/// than what a custom op is handed.
fn locked_view<'a, T: CudaDType>(storage: &'a candle_core::Storage, layout: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    match storage {
        candle_core::Storage::Cuda(cs) => view::<T>(cs, layout, what),
        _ => bail!("{what}: not on CUDA"),
    }
}

/// The device address of the first element of `t` (contiguous, f32 or bf16, on CUDA), for the
/// address tables of kernels that read many tensors of many sequences in one launch.
fn address(t: &candle_core::Tensor, stream: &candle_core::cuda_backend::cudarc::driver::CudaStream) -> Result<i64> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    if !t.is_contiguous() {
        bail!("a {:?} {:?} input is not contiguous", t.dtype(), t.dims());
    }
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*storage else { bail!("an input is not on CUDA") };
    let ptr = match t.dtype() {
        DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.device_ptr(stream).0,
        DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(stream).0,
        other => bail!("an input of dtype {other:?} where f32 or bf16 was expected"),
    };
    Ok((ptr + (layout.start_offset() * t.dtype().size_in_bytes()) as u64) as i64)
}

fn expect_dtype(t: &candle_core::Tensor, dtype: DType, what: &str) -> Result<()> {
    if t.dtype() != dtype {
        bail!("{what}: {:?} where {dtype:?} was expected", t.dtype());
    }
    Ok(())
}

fn wrap(out: CudaSlice<impl CudaDType>, dev: candle_core::CudaDevice, shape: impl Into<candle_core::Shape>) -> candle_core::Tensor {
    let storage = candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev));
    candle_core::Tensor::from_storage(storage, shape, candle_core::op::BackpropOp::none(), false)
}

/// Device addresses of `tensors` (contiguous, f32 or bf16, on CUDA; `None`: 0), for the address
/// tables of the kernels below, which read many sequences' tensors in one launch. The tensors must
/// outlive the launches that read the table.
pub fn addresses(tensors: &[Option<&candle_core::Tensor>]) -> Result<Vec<i64>> {
    let Some(first) = tensors.iter().flatten().next() else { return Ok(vec![0; tensors.len()]) };
    let stream = first.device().as_cuda_device()?.cuda_stream();
    tensors.iter().map(|t| t.map_or(Ok(0), |t| address(t, &stream))).collect()
}

/// Whether the kernel serves this shape: a lane holds at most 4 of the d dimensions, a block at
/// most 8 query heads per KV head (kernels/decode_attention.cu).
pub fn decode_attention_fits(heads: usize, kv_heads: usize, d: usize) -> bool {
    d <= 128 && kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 8
}

/// One decode step of n sequences at one layer (kernels/decode_attention.cu): appends row j of
/// `k`, `v` (`[n, kv_heads, d]` bf16, after RoPE) to sequence j's cache and returns the attention
/// of row j of `q` (`[n, heads, d]`, after RoPE) over its keys, `[n, heads, d]` bf16. One launch.
/// `caches`: i64 `[2, n]`, the addresses of each sequence's key and value buffers at this layer
/// (`[kv_heads, capacity, d]` bf16); `counts`: u32 `[2, n]`, its keys after the append and its
/// capacity; `bias`: i64 `[n]`, the address of each one's f32 key bias of `len` values, or 0.
pub fn decode_attention(
    q: &candle_core::Tensor,
    k: &candle_core::Tensor,
    v: &candle_core::Tensor,
    caches: &candle_core::Tensor,
    counts: &candle_core::Tensor,
    bias: Option<&candle_core::Tensor>,
) -> Result<candle_core::Tensor> {
    let (n, heads, d) = q.dims3()?;
    let kv_heads = k.dim(1)?;
    if !decode_attention_fits(heads, kv_heads, d)
        || k.dims3()? != (n, kv_heads, d)
        || v.dims() != k.dims()
        || caches.dims2()? != (2, n)
        || counts.dims2()? != (2, n)
        || bias.is_some_and(|b| b.dims() != [n])
    {
        bail!("decode-attention: q {:?}, k {:?}, v {:?}, caches {:?}, counts {:?}", q.dims(), k.dims(), v.dims(), caches.dims(), counts.dims());
    }
    for t in [q, k, v] {
        expect_dtype(t, DType::BF16, "decode-attention q/k/v")?;
    }
    expect_dtype(caches, DType::I64, "decode-attention caches")?;
    expect_dtype(counts, DType::U32, "decode-attention counts")?;
    let dev = q.device().as_cuda_device()?.clone();
    let (q, k, v, caches, counts) = (q.contiguous()?, k.contiguous()?, v.contiguous()?, caches.contiguous()?, counts.contiguous()?);
    let out: CudaSlice<half::bf16> = unsafe { dev.alloc::<half::bf16>(n * heads * d)? };
    {
        let qg: Vec<_> = [&q, &k, &v].iter().map(|t| t.storage_and_layout()).collect();
        let qkv = qg.iter().map(|(s, l)| locked_view::<half::bf16>(s, l, "decode-attention q/k/v")).collect::<Result<Vec<_>>>()?;
        let (tables, lens) = (caches.chunk(2, 0)?, counts.chunk(2, 0)?);
        let tg: Vec<_> = tables.iter().chain(bias).map(|t| t.storage_and_layout()).collect();
        let tv = tg.iter().map(|(s, l)| locked_view::<i64>(s, l, "decode-attention addresses")).collect::<Result<Vec<_>>>()?;
        let cg: Vec<_> = lens.iter().map(|t| t.storage_and_layout()).collect();
        let cv = cg.iter().map(|(s, l)| locked_view::<u32>(s, l, "decode-attention counts")).collect::<Result<Vec<_>>>()?;
        let (h, kvh, dd, scale) = (heads as i32, kv_heads as i32, d as i32, 1.0f32 / (d as f32).sqrt());
        let null = 0u64;
        let func = dev.get_or_load_custom_func("decode_attention_bf16", "lift_decode_attention", DECODE_ATTENTION_PTX)?;
        let mut builder = func.builder();
        for x in &qkv {
            builder.arg(x);
        }
        builder.arg(&tv[0]);
        builder.arg(&tv[1]);
        match tv.get(2) {
            Some(b) => builder.arg(b),
            None => builder.arg(&null),
        };
        for x in &cv {
            builder.arg(x);
        }
        builder.arg(&out);
        builder.arg(&h);
        builder.arg(&kvh);
        builder.arg(&dd);
        builder.arg(&scale);
        // 8 warps (DA_WARPS in the kernel): a block per (sequence, KV head).
        let cfg = LaunchConfig { grid_dim: ((n * kv_heads) as u32, 1, 1), block_dim: (32 * 8, 1, 1), shared_mem_bytes: 0 };
        unsafe { builder.launch(cfg) }.w()?;
    }
    Ok(wrap(out, dev, (n, heads, d)))
}

/// The Gated Memory mix of a decode step's rows (`q` pre-RoPE, `attn`: `[b, heads, t, d]` f32),
/// row b with the packed layer parameters at address `params[b]` (i64 `[b]`; 0: it passes
/// through), in one launch (`gated_memory_fwd_rows` in kernels/gated_memory.cu). Every row's
/// layer has shapes `dims`.
pub fn gated_memory_fwd_rows(
    q: &candle_core::Tensor,
    attn: &candle_core::Tensor,
    params: &candle_core::Tensor,
    dims: GmDims,
) -> Result<candle_core::Tensor> {
    let (b, h, t, d) = q.dims4()?;
    if (h, d) != (dims.heads, dims.d) || attn.dims() != q.dims() || params.dims() != [b] {
        bail!("gated-memory-rows: q {:?} / attn {:?} / {:?} addresses for {dims:?}", q.dims(), attn.dims(), params.dims());
    }
    expect_dtype(q, DType::F32, "gated-memory-rows q")?;
    expect_dtype(attn, DType::F32, "gated-memory-rows attn")?;
    expect_dtype(params, DType::I64, "gated-memory-rows addresses")?;
    let dev = q.device().as_cuda_device()?.clone();
    let (q, attn, params) = (q.contiguous()?, attn.contiguous()?, params.contiguous()?);
    let out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(q.elem_count())? };
    {
        let locked: Vec<_> = [&q, &attn].iter().map(|t| t.storage_and_layout()).collect();
        let qa = locked.iter().map(|(s, l)| locked_view::<f32>(s, l, "gated-memory-rows q/attn")).collect::<Result<Vec<_>>>()?;
        let (ts, tl) = params.storage_and_layout();
        let tv = locked_view::<i64>(&ts, tl, "gated-memory-rows addresses")?;
        let (cfg, tr) = gm_launch(dims, b, t, 3 * dims.d + dims.s + 1);
        let params = gm_params(dims, t);
        let func = dev.get_or_load_custom_func("gated_memory_fwd_rows", "lift_gated_memory", GATED_MEMORY_PTX)?;
        let mut builder = func.builder();
        builder.arg(&qa[0]);
        builder.arg(&qa[1]);
        builder.arg(&tv);
        builder.arg(&out);
        builder.arg(&params);
        builder.arg(&tr);
        unsafe { builder.launch(cfg) }.w()?;
    }
    Ok(wrap(out, dev, (b, h, t, d)))
}

const ADAMW_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/adamw.ptx"));

/// `AdamWScalars` in kernels/adamw.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AdamWScalars {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub lr: f32,
    /// 1 − lr · weight decay.
    pub decay: f32,
    /// The bias corrections 1 − β₁ᵗ and 1 − β₂ᵗ.
    pub bc1: f32,
    pub bc2: f32,
    pub max_norm: f32,
}
unsafe impl DeviceRepr for AdamWScalars {}

/// One AdamW step of every tensor in `params` in place (kernels/adamw.cu): their gradients
/// clipped to global norm `s.max_norm` when `clip`, the moments `m`, `v` updated in place.
/// Every tensor f32, contiguous, on one CUDA device; two launches, no host sync.
pub fn adamw_step(
    params: &[&candle_core::Tensor],
    grads: &[candle_core::Tensor],
    m: &[candle_core::Tensor],
    v: &[candle_core::Tensor],
    s: AdamWScalars,
    clip: bool,
) -> Result<()> {
    let n = params.len();
    if n == 0 {
        return Ok(());
    }
    if grads.len() != n || m.len() != n || v.len() != n {
        bail!("adamw: {n} parameters, {} gradients, {}/{} moments", grads.len(), m.len(), v.len());
    }
    let dev = params[0].device().as_cuda_device()?.clone();
    let mut tables: [Vec<i64>; 5] = Default::default();
    let mut largest = 1;
    for j in 0..n {
        let size = params[j].elem_count();
        let row = [params[j], &grads[j], &m[j], &v[j]];
        for (t, what) in row.iter().zip(["parameter", "gradient", "first moment", "second moment"]) {
            expect_dtype(t, DType::F32, "adamw")?;
            if t.elem_count() != size {
                bail!("adamw: a {what} of {:?} for a parameter of {:?}", t.dims(), params[j].dims());
            }
        }
        for (table, a) in tables.iter_mut().zip(addresses(&row.map(Some))?) {
            table.push(a);
        }
        tables[4].push(size as i64);
        largest = largest.max(size);
    }
    let tables = tables.iter().map(|t| candle_core::Tensor::new(t.as_slice(), params[0].device())).collect::<candle_core::Result<Vec<_>>>()?;
    let locked: Vec<_> = tables.iter().map(|t| t.storage_and_layout()).collect();
    let views = locked.iter().map(|(st, l)| locked_view::<i64>(st, l, "adamw table")).collect::<Result<Vec<_>>>()?;
    // Blocks per tensor: enough for the largest, at most 32 (they stride).
    let cfg = LaunchConfig {
        grid_dim: (largest.div_ceil(THREADS as usize).min(32) as u32, n as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let sumsq: Option<CudaSlice<f32>> = if clip {
        let out = dev.alloc_zeros::<f32>(1)?;
        let func = dev.get_or_load_custom_func("adamw_sum_squares", "lift_adamw", ADAMW_PTX)?;
        let mut builder = func.builder();
        builder.arg(&views[1]);
        builder.arg(&views[4]);
        builder.arg(&out);
        unsafe { builder.launch(cfg) }.w()?;
        Some(out)
    } else {
        None
    };
    let null = 0u64;
    let func = dev.get_or_load_custom_func("adamw_update", "lift_adamw", ADAMW_PTX)?;
    let mut builder = func.builder();
    for view in &views {
        builder.arg(view);
    }
    match &sumsq {
        Some(out) => builder.arg(out),
        None => builder.arg(&null),
    };
    builder.arg(&s);
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}
