//! Frozen base-model weights. Each linear layer keeps the file's representation for inference
//! (quantized blocks stay quantized) and a float copy for the trainable path, made on first use.
//! Float weights are f32 on the CPU and bf16 on CUDA (`RuntimeConfig::base_dtype`); adapters
//! stay f32.

use super::ops;
use crate::kernels::bf16_matmul;
use crate::kernels::quant_matmul::{BlockFormat, Isa, PackedWeights};
use crate::runtime::RuntimeConfig;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Module, Result, Tensor};
use std::sync::{Arc, OnceLock};

pub struct Linear {
    /// Inference weight: quantized matmul, or a float matmul for float files.
    infer: QMatMul,
    /// Source of the float copy when the file is quantized.
    quantized: Option<Arc<QTensor>>,
    /// The quantized weight repacked for our int8 kernel (`kernels::quant_matmul`), on CPUs
    /// that run it; replaces `infer` for f32 activations on the CPU.
    packed: Option<PackedWeights>,
    /// `[out, in]` in `dtype`, frozen: never a `Var`, never receives a gradient.
    float: OnceLock<Tensor>,
    /// The float weights' dtype (`RuntimeConfig::base_dtype`), kept for the copy made on first use.
    dtype: DType,
    /// The float weight transposed, `[in, out]` contiguous, on the CPU only: the forward gemm runs
    /// faster on it than on a transposed view (the backward uses `float`). Costs one more float
    /// copy of the weights (~0.5 GB on the 135M model), made on first use.
    float_t: OnceLock<Tensor>,
    /// The float weight packed in bf16 for the mixed-precision matmul of the trainable path and
    /// prefill (`ops::frozen_linear_bf16`), on CPUs that run it; made on first use.
    bf16: OnceLock<Arc<ops::Bf16Weight>>,
    bias: Option<Tensor>,
    out_dim: usize,
    in_dim: usize,
}

impl Linear {
    /// Weight `[out, in]` as stored in a GGUF file; float types are dequantized right away.
    pub fn from_qtensor(q: QTensor, bias: Option<Tensor>, runtime: &RuntimeConfig) -> Result<Self> {
        let (out_dim, in_dim) = q.shape().dims2()?;
        let dtype = runtime.base_dtype(&q.device());
        let bias = bias.map(|b| b.to_dtype(dtype)).transpose()?;
        let q = Arc::new(q);
        let infer = QMatMul::from_arc(q.clone())?;
        let float = OnceLock::new();
        let quantized = match &infer {
            QMatMul::Tensor(t) => {
                let _ = float.set(t.to_dtype(dtype)?);
                None
            }
            _ => Some(q),
        };
        let packed = match &quantized {
            Some(q) => pack_for_cpu(q, runtime.quant_matmul_isa())?,
            None => None,
        };
        let (float_t, bf16) = (OnceLock::new(), OnceLock::new());
        Ok(Self { infer, quantized, packed, float, dtype, float_t, bf16, bias, out_dim, in_dim })
    }

    /// Float weight `[out, in]` (any float dtype; kept in `RuntimeConfig::base_dtype`).
    pub fn from_tensor(w: Tensor, bias: Option<Tensor>, runtime: &RuntimeConfig) -> Result<Self> {
        let dtype = runtime.base_dtype(w.device());
        let w = w.to_dtype(dtype)?;
        let (out_dim, in_dim) = w.dims2()?;
        let float = OnceLock::new();
        let _ = float.set(w.clone());
        let bias = bias.map(|b| b.to_dtype(dtype)).transpose()?;
        Ok(Self {
            infer: QMatMul::Tensor(w),
            quantized: None,
            packed: None,
            float,
            dtype,
            float_t: OnceLock::new(),
            bf16: OnceLock::new(),
            bias,
            out_dim,
            in_dim,
        })
    }

    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    pub fn in_dim(&self) -> usize {
        self.in_dim
    }

    pub fn is_quantized(&self) -> bool {
        self.quantized.is_some()
    }

    /// Whether inference (`forward`) reads the quantized blocks, which an update merged into the
    /// float copy (`merge_into_float`) does not reach: a quantized file, except on CUDA, where a
    /// quantized layer runs through its float copy (the merged one).
    pub fn infers_from_quantized(&self) -> bool {
        self.quantized.as_ref().is_some_and(|q| !q.device().is_cuda())
    }

    /// Whether inference on the CPU runs our int8 kernel (`kernels::quant_matmul`).
    pub fn is_packed(&self) -> bool {
        self.packed.is_some()
    }

    /// The version of our int8 kernel inference runs, if it runs on it.
    pub fn packed_isa(&self) -> Option<Isa> {
        self.packed.as_ref().and_then(PackedWeights::isa)
    }

    /// Goes back to candle's quantized matmul for inference (drops the repacked copy).
    pub fn drop_packed(&mut self) {
        self.packed = None;
    }

    /// The float copy (in `dtype`), dequantized once on first call.
    pub fn float_weight(&self) -> Result<&Tensor> {
        if let Some(w) = self.float.get() {
            return Ok(w);
        }
        let q =
            self.quantized.as_ref().ok_or_else(|| candle_core::Error::Msg("linear layer without weights".into()))?;
        let device = q.device();
        let w = q.dequantize(&device)?.to_dtype(self.dtype)?;
        Ok(self.float.get_or_init(|| w))
    }

    /// Inference path: quantized matmul when the file is quantized. Activations that are not f32
    /// (bf16 on CUDA) go through the quantized kernels in f32, or through the float weights.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // candle's CUDA quantized matmul gave wrong products on the first GPU run (H100, CUDA
        // 13: 98–102% off the CPU for every shape tried, Q8_0 and Q4_1, 1–40 rows), while
        // dequantization is exact: on CUDA a quantized layer runs through its bf16 float copy.
        if x.device().is_cuda() && self.quantized.is_some() {
            let float = self.forward_float(&x.to_dtype(self.dtype)?, false)?;
            return float.to_dtype(x.dtype());
        }
        if x.dtype() != DType::F32 {
            if self.quantized.is_none() {
                return self.forward_float(x, false);
            }
            let y = self.infer.forward(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype())?;
            return self.add_bias(y);
        }
        if let Some(packed) = &self.packed {
            return self.add_bias(packed_forward(packed, x)?);
        }
        let y = self.infer.forward(x)?;
        self.add_bias(y)
    }

    /// Inference path through the float weights: faster than block-quantized dot products for
    /// long prompts (prefill), where the matmul is compute-bound. With `bf16` (on the CPU, where
    /// the kernel runs) the matmul rounds its inputs to bf16 and sums in f32
    /// (`ops::frozen_linear_bf16`, ~2× the f32 gemm); the gradient flows to `x` only.
    pub fn forward_float(&self, x: &Tensor, bf16: bool) -> Result<Tensor> {
        let w = self.float_weight()?;
        if bf16 && x.device().is_cpu() && x.dtype() == DType::F32 && bf16_matmul::available() {
            let packed = match self.bf16.get() {
                Some(p) => p,
                None => {
                    let p = Arc::new(ops::Bf16Weight::new(w)?);
                    self.bf16.get_or_init(|| p)
                }
            };
            return self.add_bias(ops::frozen_linear_bf16(x, w, packed)?);
        }
        let y = match self.float_transposed()? {
            Some(wt) => ops::frozen_linear_pretransposed(x, w, wt)?,
            None => ops::frozen_linear(x, w)?,
        };
        self.add_bias(y)
    }

    /// Adds `delta` (`[out, in]`) to the float weight, for good: a frozen low-rank update merged
    /// once costs nothing per token afterwards. Quantized inference weights are left as they are
    /// (requantizing would round a small update away), so on a quantized file the caller keeps
    /// applying the update on the quantized path; `infers_from_quantized` says whether it must.
    pub fn merge_into_float(&mut self, delta: &Tensor) -> Result<()> {
        let w = self.float_weight()?;
        let merged = (w + delta.to_dtype(w.dtype())?)?;
        self.float = OnceLock::new();
        let _ = self.float.set(merged.clone());
        self.float_t = OnceLock::new();
        self.bf16 = OnceLock::new();
        if self.quantized.is_none() {
            self.infer = QMatMul::Tensor(merged);
        }
        Ok(())
    }

    /// Makes the float copies (`float`, and `float_t` on the CPU) now instead of on first use.
    pub fn prepare_float(&self) -> Result<()> {
        self.float_transposed().map(|_| ())
    }

    /// `float_t`, made on first call; `None` off the CPU.
    fn float_transposed(&self) -> Result<Option<&Tensor>> {
        if let Some(wt) = self.float_t.get() {
            return Ok(Some(wt));
        }
        let w = self.float_weight()?;
        if !w.device().is_cpu() {
            return Ok(None);
        }
        let wt = w.t()?.contiguous()?;
        Ok(Some(self.float_t.get_or_init(|| wt)))
    }

    /// Trainable path: the float weights (`forward_float`), gradient flows to `x` only.
    pub fn forward_train(&self, x: &Tensor, bf16: bool) -> Result<Tensor> {
        self.forward_float(x, bf16)
    }

    fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// `q` repacked for `kernels::quant_matmul`'s `isa` version when it is on the CPU and in a block
/// format the kernel reads; `isa` is `None` where candle's kernels run instead
/// (`RuntimeConfig::quant_matmul_isa`).
fn pack_for_cpu(q: &QTensor, isa: Option<Isa>) -> Result<Option<PackedWeights>> {
    let format = match q.dtype() {
        GgmlDType::Q4_0 => BlockFormat::Q4_0,
        GgmlDType::Q4_1 => BlockFormat::Q4_1,
        GgmlDType::Q5_0 => BlockFormat::Q5_0,
        GgmlDType::Q8_0 => BlockFormat::Q8_0,
        GgmlDType::Q4K => BlockFormat::Q4K,
        GgmlDType::Q6K => BlockFormat::Q6K,
        _ => return Ok(None),
    };
    let Some(isa) = isa.filter(|_| q.device().is_cpu()) else { return Ok(None) };
    let (rows, cols) = q.shape().dims2()?;
    if cols % format.block_weights() != 0 {
        return Ok(None);
    }
    let packed = PackedWeights::pack(format, &q.data()?, rows, cols).map_err(candle_core::Error::Msg)?;
    Ok(Some(packed.run_on(isa)))
}

/// `x` `[…, in]` (f32, CPU) through the packed kernel: `[…, out]`.
fn packed_forward(packed: &PackedWeights, x: &Tensor) -> Result<Tensor> {
    let (dims, n, data) = packed_input(packed.cols(), x)?;
    output(packed.matmul(&data, n), &dims, packed.rows(), x)
}

/// `x` `[…, cols]` as (leading dims, rows, f32 data).
fn packed_input(cols: usize, x: &Tensor) -> Result<(Vec<usize>, usize, Vec<f32>)> {
    let mut dims = x.dims().to_vec();
    let last = dims.pop().unwrap_or(0);
    if last != cols {
        candle_core::bail!("linear layer of {cols} inputs applied to {last}");
    }
    let n = dims.iter().product();
    Ok((dims, n, x.flatten_all()?.to_vec1::<f32>()?))
}

fn output(y: Vec<f32>, lead: &[usize], rows: usize, x: &Tensor) -> Result<Tensor> {
    let mut dims = lead.to_vec();
    dims.push(rows);
    Tensor::from_vec(y, dims, x.device())
}

/// `forward` of several layers over one input (a layer's q, k, v; gate and up): one pass of the
/// int8 kernel (`PackedWeights::matmul_group`: the input quantized once) when all run on it,
/// with the same results as one by one.
pub fn forward_group(lins: &[&Linear], x: &Tensor) -> Result<Vec<Tensor>> {
    let packed: Vec<&PackedWeights> = lins.iter().filter_map(|l| l.packed.as_ref()).collect();
    let same_input = packed.iter().all(|p| p.cols() == packed[0].cols());
    if lins.len() < 2 || packed.len() < lins.len() || !same_input || !x.device().is_cpu() || x.dtype() != DType::F32 {
        return lins.iter().map(|l| l.forward(x)).collect();
    }
    let (dims, n, data) = packed_input(packed[0].cols(), x)?;
    let ys = PackedWeights::matmul_group(&packed, &data, n);
    lins.iter().zip(ys).map(|(l, y)| l.add_bias(output(y, &dims, l.out_dim, x)?)).collect()
}

/// A float tensor of a norm or embedding: always dequantized.
pub fn dequantize(q: &QTensor) -> Result<Tensor> {
    q.dequantize(&q.device())?.to_dtype(DType::F32)
}
