//! The inference path's per-sequence key/value cache ([`KvCache`]): CPU buffers of the
//! decoder's `kv_dtype` or device tensors, grown by doubling.

use crate::kernels::math::StoredFloat;
use candle_core::{DType, Device, Result, Tensor};
use half::f16;

/// Per-sequence key/value cache for the inference path; grows by doubling.
///
/// On the CPU keys and values sit in plain buffers of the decoder's `kv_dtype`: f16 by default
/// (llama.cpp's default cache type) — a decode step of many sequences reads every cached key
/// and value once, and at 16 sequences of ~60 tokens those f32 reads (46 MB a step, more than
/// the L3) were a sixth of the step — or f32. Elsewhere they are tensors in the model's dtype.
/// Every reader sees the same stored values, the token just appended included, so a
/// sequence's arithmetic does not depend on which path reads its cache.
pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    len: usize,
    capacity: usize,
}

/// One layer's keys and values.
#[derive(Clone)]
pub(super) enum LayerKv {
    F16(HostKv<f16>),
    F32(HostKv<f32>),
    /// `[b, kv_heads, capacity, d]` tensors.
    Device { k: Tensor, v: Tensor },
}

/// CPU buffers `[rows, capacity, d]`, `rows` = batch × KV heads.
#[derive(Clone)]
pub(super) struct HostKv<T> {
    k: Vec<T>,
    v: Vec<T>,
    batch: usize,
    heads: usize,
    d: usize,
}

impl<T: StoredFloat> HostKv<T> {
    fn new(batch: usize, heads: usize, d: usize, capacity: usize) -> Self {
        let zeros = vec![T::default(); batch * heads * capacity * d];
        Self { k: zeros.clone(), v: zeros, batch, heads, d }
    }

    /// The same first `len` positions in buffers of `capacity` positions (from `old_cap`).
    fn regrown(&self, len: usize, old_cap: usize, capacity: usize) -> Self {
        let mut new = Self::new(self.batch, self.heads, self.d, capacity);
        let d = self.d;
        for (dst, src) in [(&mut new.k, &self.k), (&mut new.v, &self.v)] {
            for r in 0..self.batch * self.heads {
                dst[r * capacity * d..][..len * d].copy_from_slice(&src[r * old_cap * d..][..len * d]);
            }
        }
        new
    }

    /// Writes positions `len..len + t` from `k`, `v` (`[rows, t, d]` f32, row-major).
    fn write(&mut self, len: usize, capacity: usize, t: usize, k: &[f32], v: &[f32]) {
        let d = self.d;
        for (buf, x) in [(&mut self.k, k), (&mut self.v, v)] {
            for (r, src) in x.chunks_exact(t * d).enumerate() {
                T::from_f32s(src, &mut buf[(r * capacity + len) * d..][..t * d]);
            }
        }
    }

    /// The first `len` positions as `[b, kv_heads, len, d]` f32 tensors.
    fn views(&self, len: usize, capacity: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        let (b, h, d) = (self.batch, self.heads, self.d);
        let view = |buf: &[T]| -> Result<Tensor> {
            let mut out = vec![0f32; b * h * len * d];
            for (r, dst) in out.chunks_exact_mut(len * d).enumerate() {
                T::to_f32s(&buf[r * capacity * d..][..len * d], dst);
            }
            Tensor::from_vec(out, (b, h, len, d), device)
        };
        Ok((view(&self.k)?, view(&self.v)?))
    }
}

impl LayerKv {
    fn from_host<T: HostElem>(h: HostKv<T>) -> Self {
        T::wrap(h)
    }

    /// Zeroed buffers of `capacity` positions for keys shaped like `k` (`[b, kv_heads, t, d]`).
    fn empty(k: &Tensor, kv_dtype: DType, capacity: usize) -> Result<Self> {
        let (b, h, _, d) = k.dims4()?;
        Ok(match (k.device().is_cpu(), kv_dtype) {
            (true, DType::F16) => LayerKv::F16(HostKv::new(b, h, d, capacity)),
            (true, _) => LayerKv::F32(HostKv::new(b, h, d, capacity)),
            (false, _) => {
                let zeros = Tensor::zeros((b, h, capacity, d), k.dtype(), k.device())?;
                LayerKv::Device { k: zeros.clone(), v: zeros.copy()? }
            }
        })
    }

    fn bytes(&self) -> usize {
        match self {
            LayerKv::F16(h) => (h.k.len() + h.v.len()) * 2,
            LayerKv::F32(h) => (h.k.len() + h.v.len()) * 4,
            LayerKv::Device { k, v } => (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes(),
        }
    }

    fn regrown(&self, len: usize, old_cap: usize, capacity: usize) -> Result<Self> {
        Ok(match self {
            LayerKv::F16(h) => LayerKv::F16(h.regrown(len, old_cap, capacity)),
            LayerKv::F32(h) => LayerKv::F32(h.regrown(len, old_cap, capacity)),
            LayerKv::Device { k, v } => {
                let (b, h, _, d) = k.dims4()?;
                let nk = Tensor::zeros((b, h, capacity, d), k.dtype(), k.device())?;
                let nv = Tensor::zeros((b, h, capacity, d), v.dtype(), v.device())?;
                if len > 0 {
                    nk.slice_set(&k.narrow(2, 0, len)?, 2, 0)?;
                    nv.slice_set(&v.narrow(2, 0, len)?, 2, 0)?;
                }
                LayerKv::Device { k: nk, v: nv }
            }
        })
    }
}

/// The CPU cache element types, and how to find a layer's buffers of each.
pub(super) trait HostElem: StoredFloat {
    fn wrap(h: HostKv<Self>) -> LayerKv;
    fn host(layer: &LayerKv) -> Option<&HostKv<Self>>;
    fn host_mut(layer: &mut LayerKv) -> Option<&mut HostKv<Self>>;
}

impl HostElem for f16 {
    fn wrap(h: HostKv<f16>) -> LayerKv {
        LayerKv::F16(h)
    }

    fn host(layer: &LayerKv) -> Option<&HostKv<f16>> {
        if let LayerKv::F16(h) = layer { Some(h) } else { None }
    }

    fn host_mut(layer: &mut LayerKv) -> Option<&mut HostKv<f16>> {
        if let LayerKv::F16(h) = layer { Some(h) } else { None }
    }
}

impl HostElem for f32 {
    fn wrap(h: HostKv<f32>) -> LayerKv {
        LayerKv::F32(h)
    }

    fn host(layer: &LayerKv) -> Option<&HostKv<f32>> {
        if let LayerKv::F32(h) = layer { Some(h) } else { None }
    }

    fn host_mut(layer: &mut LayerKv) -> Option<&mut HostKv<f32>> {
        if let LayerKv::F32(h) = layer { Some(h) } else { None }
    }
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self::with_capacity(num_layers, 0)
    }

    /// A cache whose buffers are made for `tokens` tokens at the first append (it still grows
    /// past them): a generation that knows its length never copies its cache to grow it, and
    /// holds what the engine's memory budget counted for it.
    pub fn with_capacity(num_layers: usize, tokens: usize) -> Self {
        Self { layers: (0..num_layers).map(|_| None).collect(), len: 0, capacity: tokens }
    }

    /// Tokens already in the cache (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by the cache buffers.
    pub fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(LayerKv::bytes).sum()
    }

    /// A deep copy (so a shared prompt prefix can be extended by several requests).
    pub fn fork(&self) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                Some(LayerKv::Device { k, v }) => Ok(Some(LayerKv::Device { k: k.copy()?, v: v.copy()? })),
                other => Ok(other.clone()),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { layers, len: self.len, capacity: self.capacity })
    }

    /// Forgets everything after the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Room for `t` more tokens in every layer (grown at layer 0, before any layer appends).
    fn reserve(&mut self, layer: usize, t: usize) -> Result<()> {
        let needed = self.len + t;
        if layer == 0 && needed > self.capacity {
            let new_cap = needed.max(self.capacity * 2).max(64);
            for entry in self.layers.iter_mut().flatten() {
                *entry = entry.regrown(self.len, self.capacity, new_cap)?;
            }
            self.capacity = new_cap;
        }
        Ok(())
    }

    /// Appends `k`, `v` (`[b, kv_heads, t, d]`) for `layer` and returns views of the whole cache
    /// (`[b, kv_heads, len + t, d]`, in `k`'s dtype). A new layer's buffers are made in
    /// `kv_dtype` on the CPU. `self.len` is advanced by `commit` once every layer has appended.
    pub(super) fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor, kv_dtype: DType) -> Result<(Tensor, Tensor)> {
        let (b, h, t, d) = k.dims4()?;
        self.reserve(layer, t)?;
        let (len, cap) = (self.len, self.capacity);
        let entry = match &mut self.layers[layer] {
            Some(entry) => entry,
            empty => empty.insert(LayerKv::empty(k, kv_dtype, cap)?),
        };
        let rows = |x: &Tensor| x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
        let (kv, vv) = match entry {
            LayerKv::Device { k: ck, v: cv } => {
                ck.slice_set(&k.contiguous()?, 2, len)?;
                cv.slice_set(&v.contiguous()?, 2, len)?;
                return Ok((ck.narrow(2, 0, len + t)?, cv.narrow(2, 0, len + t)?));
            }
            LayerKv::F16(hk) if (hk.batch, hk.heads, hk.d) == (b, h, d) => {
                hk.write(len, cap, t, &rows(k)?, &rows(v)?);
                hk.views(len + t, cap, k.device())?
            }
            LayerKv::F32(hk) if (hk.batch, hk.heads, hk.d) == (b, h, d) => {
                hk.write(len, cap, t, &rows(k)?, &rows(v)?);
                hk.views(len + t, cap, k.device())?
            }
            _ => candle_core::bail!("appending keys of shape {:?} to layer {layer}'s cache of another shape", k.dims()),
        };
        Ok((kv.to_dtype(k.dtype())?, vv.to_dtype(v.dtype())?))
    }

    /// Appends one position of a one-sequence CPU cache (the decode kernel's path): `k`, `v`
    /// `[kv_heads, d]` in f32, stored as `append` stores them.
    pub(super) fn append_row<T: HostElem>(&mut self, layer: usize, k: &[f32], v: &[f32], heads: usize, d: usize) -> Result<()> {
        self.reserve(layer, 1)?;
        let (len, cap) = (self.len, self.capacity);
        let entry = match &mut self.layers[layer] {
            Some(entry) => entry,
            empty => empty.insert(LayerKv::from_host(HostKv::<T>::new(1, heads, d, cap))),
        };
        match T::host_mut(entry) {
            Some(hk) if (hk.batch, hk.heads, hk.d) == (1, heads, d) => {
                hk.write(len, cap, 1, k, v);
                Ok(())
            }
            _ => candle_core::bail!("layer {layer}'s cache is not one sequence's CPU buffers of {heads} heads of {d}"),
        }
    }

    /// Layer `layer`'s CPU key and value buffers (`[kv_heads, capacity, d]`, the first `len`
    /// positions filled, plus what was appended in the current step) and their capacity.
    pub(super) fn host_buffers<T: HostElem>(&self, layer: usize) -> Result<(&[T], &[T], usize)> {
        match self.layers[layer].as_ref().and_then(T::host) {
            Some(hk) => Ok((&hk.k, &hk.v, self.capacity)),
            None => candle_core::bail!("layer {layer} has no CPU cache of the decoder's KV type"),
        }
    }

    /// Room for one more position in `layer`'s device buffers (made on first use as `append`
    /// makes them, `like` giving shape and dtype): the buffers and their capacity, for the CUDA
    /// decode kernel, which writes the position itself.
    #[cfg(feature = "cuda")]
    pub(super) fn device_slot(&mut self, layer: usize, like: &Tensor) -> Result<(Tensor, Tensor, usize)> {
        self.reserve(layer, 1)?;
        let cap = self.capacity;
        let entry = match &mut self.layers[layer] {
            Some(entry) => entry,
            empty => empty.insert(LayerKv::empty(like, like.dtype(), cap)?),
        };
        match entry {
            LayerKv::Device { k, v } => Ok((k.clone(), v.clone(), cap)),
            _ => candle_core::bail!("layer {layer}'s cache is not on the device"),
        }
    }

    pub(super) fn commit(&mut self, t: usize) {
        self.len += t;
    }
}
