use candle_core::{Device, Tensor};
use lift_serve::model::Model;
fn main() -> anyhow::Result<()> {
    let path = std::path::Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let m = Model::load(path, &Device::Cpu)?;
    for text in ["The", "The history", "The history of the Roman Empire", "The history of the Roman Empire spans many centuries, and its", "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital"] {
        let mut file = std::fs::File::open(path)?;
        let content = candle_core::quantized::gguf_file::Content::read(&mut file)?;
        let mut reference = candle_transformers::models::quantized_llama::ModelWeights::from_gguf(content, &mut file, &Device::Cpu)?;
        let ids = m.tokenizer.encode(text, false)?;
        let input = Tensor::new(ids.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
        let want = reference.forward(&input, 0)?.squeeze(0)?;
        let got = m.decoder.forward_with_float_threshold(&input, usize::MAX)?.squeeze(0)?;
        let d = (&got - &want)?.abs()?.max(0)?.to_scalar::<f32>()?;
        println!("{} tokens diff {d}", ids.len());
    }
    Ok(())
}
