//! `outpost plan`: will a model fit on a hardware target, at a precision?
//!
//! Nothing here loads ONNX Runtime: the plan is made from the model file
//! (parameter count, inputs and outputs) and the target's TOML, so it runs on
//! a build host for any target.
//!
//! Reading what a model is (its file and manifest) is [`facts`]'s job;
//! this file makes the estimate from those facts.
//!
//! The estimate, per memory pool (one pool on CPU-only targets and on Jetson,
//! where CPU and GPU share LPDDR; a host pool and a device pool on a dGPU):
//!
//! - runtime = [`CPU_RUNTIME_BYTES`]: outpost, libonnxruntime's resident
//!   pages, the ONNX Runtime environment and its thread pool;
//! - graph = nodes (subgraphs included) × [`NODE_BYTES`]: ONNX Runtime's
//!   graph, kernels and execution plans;
//! - weights = parameters × bytes per parameter at the precision
//!   (fp32 4, fp16/bf16 2, int8 1);
//! - weight copies (CPU provider) = what is alive beside the weights at the
//!   peak of session creation: the parsed model file and, for Conv and
//!   ConvTranspose weights, the copy the CPU provider reorders into its
//!   blocked (NCHWc) layout: conv weights × [`CONV_WEIGHT_COPIES_TENTHS`] / 10
//!   + other weights × [`WEIGHT_COPIES_TENTHS`] / 10 (measured factors);
//! - activations = 2 × the largest input or output tensor (its dtype, free
//!   dimensions resolved from the manifest's preprocessing, × batch): the
//!   input outpost holds and the output it copies out;
//! - intermediates = [`ARENA_FACTOR`] × the peak of the intermediate tensors
//!   alive at once (shape inference and a liveness walk over the graph, see
//!   [`graph`]): ONNX Runtime's CPU arena keeps the first run's allocations
//!   and then adds the memory-pattern block the later runs use;
//! - TensorRT workspace (TensorRT provider only) = the TensorRT EP's default
//!   `trt_max_workspace_size`, 1 GiB, or `--workspace-bytes`: a ceiling for
//!   tactic selection, counted in full;
//! - on a GPU provider also [`CUDA_CONTEXT_BYTES`] on the device and
//!   [`GPU_HOST_LIBS_BYTES`] on the host of a dGPU, or
//!   [`JETSON_GPU_RUNTIME_BYTES`] in Jetson's shared pool; GPU providers also
//!   keep the ONNX initializers (the file's weights at fp32) on the host.
//!
//! The CPU constants are measured (`outpost bench` peak RSS on x86_64, see
//! cross/README.md); the GPU ones are not measured here.
//!
//! Verdict per pool: used ≤ 80 % of capacity fits, ≤ 100 % is tight, more
//! does not fit; the plan's verdict is its worst pool's.

mod facts;
pub mod flash;
pub mod graph;
pub mod target;

use serde::Serialize;

pub use self::facts::{ModelFacts, dtype_bytes, model_facts};
use self::graph::GraphFacts;
use self::target::{Precision, Target};
use crate::backend::{Dim, Provider};

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;
/// outpost + libonnxruntime + the ONNX Runtime environment: `outpost bench`
/// peaks at 35.5-36.9 MB RSS on x86_64 for models of a few nodes and
/// kilobytes of weights (the package's binary and the release build).
pub const CPU_RUNTIME_BYTES: u64 = 34 * MIB;
/// Per node (subgraph nodes and Constant nodes included): ONNX Runtime's
/// graph, kernel and plan structures.
pub const NODE_BYTES: u64 = 8 * KIB;
/// Conv/ConvTranspose weights, in tenths of their bytes: what is alive beside
/// them at the peak of session creation (the parsed model file, the CPU
/// provider's reordered NCHWc copy, less what is already released). Measured:
/// 2.8x the weight bytes in all for a conv stack with 56.6 MB of weights.
pub const CONV_WEIGHT_COPIES_TENTHS: u64 = 18;
/// Other weights (Gemm, MatMul, ...), in tenths: the parsed model file and the
/// prepacked form overlap less. Measured: 1.5x (MatMul, 67.1 MB) and 1.7x
/// (Gemm, 50.4 MB) in all.
pub const WEIGHT_COPIES_TENTHS: u64 = 6;
/// ONNX Runtime's CPU arena keeps the first run's allocations and adds the
/// memory-pattern block of the later runs: twice the intermediate peak.
pub const ARENA_FACTOR: u64 = 2;
/// CUDA context plus cuDNN / cuBLAS handles on a dGPU: 300–500 MB measured
/// on T4 / L4 class cards; the upper end.
pub const CUDA_CONTEXT_BYTES: u64 = 500 * MIB;
/// Resident pages of the CUDA, cuDNN, cuBLAS and TensorRT libraries in the
/// host process of a dGPU server.
pub const GPU_HOST_LIBS_BYTES: u64 = 512 * MIB;
/// Jetson: "CUDA + cuDNN + TensorRT libraries alone take roughly 1 GiB of the
/// shared pool once a session is created" (targets/jetson-orin-nano-8gb.toml).
pub const JETSON_GPU_RUNTIME_BYTES: u64 = 1024 * MIB;
/// ONNX Runtime TensorRT EP default `trt_max_workspace_size` (1 GiB).
pub const TRT_WORKSPACE_DEFAULT_BYTES: u64 = 1024 * MIB;
/// Share of a pool's capacity up to which a plan "fits".
pub const FITS_FRACTION: f64 = 0.8;

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(
        "target `{target}` does not list precision {precision} (it lists {listed}); pick one of those with --precision"
    )]
    PrecisionNotListed {
        target: String,
        precision: Precision,
        listed: String,
    },
    #[error("target `{target}` does not list provider {provider} (it lists {listed})")]
    ProviderNotListed {
        target: String,
        provider: Provider,
        listed: String,
    },
    #[error("batch must be at least 1")]
    ZeroBatch,
}

/// What to plan: target, precision, provider, batch.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    pub precision: Option<Precision>,
    pub provider: Option<Provider>,
    pub batch: u64,
    pub workspace_bytes: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Fits,
    Tight,
    DoesNotFit,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Fits => "fits",
            Verdict::Tight => "tight",
            Verdict::DoesNotFit => "does not fit",
        }
    }

    fn of(used: u64, capacity: u64) -> Verdict {
        if (used as f64) <= capacity as f64 * FITS_FRACTION {
            Verdict::Fits
        } else if used <= capacity {
            Verdict::Tight
        } else {
            Verdict::DoesNotFit
        }
    }
}

/// One line of a pool's estimate.
#[derive(Debug, Clone, Serialize)]
pub struct Item {
    pub what: &'static str,
    pub bytes: u64,
    pub formula: String,
}

/// One memory pool: host RAM, dGPU memory, or Jetson's shared LPDDR.
#[derive(Debug, Clone, Serialize)]
pub struct Pool {
    pub name: &'static str,
    pub capacity_bytes: u64,
    pub items: Vec<Item>,
    pub used_bytes: u64,
    pub headroom_bytes: i64,
    pub verdict: Verdict,
}

impl Pool {
    fn new(name: &'static str, capacity_bytes: u64, items: Vec<Item>) -> Pool {
        let used_bytes = items.iter().map(|i| i.bytes).sum();
        Pool {
            name,
            capacity_bytes,
            used_bytes,
            headroom_bytes: capacity_bytes as i64 - used_bytes as i64,
            verdict: Verdict::of(used_bytes, capacity_bytes),
            items,
        }
    }
}

/// A plan, as `plan --json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub model: String,
    pub model_path: String,
    pub target: String,
    pub precision: Precision,
    pub provider: Provider,
    pub batch: u64,
    pub parameters: u64,
    pub model_file_bytes: u64,
    pub weights_bytes: u64,
    pub activations_bytes: u64,
    /// ARENA_FACTOR x the intermediate peak (0 when the graph was not read).
    pub intermediates_bytes: u64,
    pub workspace_bytes: u64,
    pub runtime_overhead_bytes: u64,
    pub total_bytes: u64,
    pub pools: Vec<Pool>,
    pub verdict: Verdict,
    /// The worst pool's headroom (negative: short by that much).
    pub headroom_bytes: i64,
    /// What the graph walk found (absent when the file was not read).
    pub graph: Option<GraphFacts>,
    pub notes: Vec<String>,
}

fn listed<T: std::fmt::Display>(v: &[T]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Makes the plan; refuses a precision or provider the target does not list.
pub fn plan(model: &ModelFacts, target: &Target, req: &PlanRequest) -> Result<Plan, PlanError> {
    if req.batch == 0 {
        return Err(PlanError::ZeroBatch);
    }
    let rt = &target.runtime;
    let precision = req.precision.unwrap_or(rt.default_precision);
    if !rt.precisions.contains(&precision) {
        return Err(PlanError::PrecisionNotListed {
            target: target.name.clone(),
            precision,
            listed: listed(&rt.precisions),
        });
    }
    // The first provider listed is the one the target is planned for; a
    // target without a GPU only lists cpu (validated at load).
    let provider = match req.provider {
        Some(p) if !rt.providers.contains(&p) => {
            return Err(PlanError::ProviderNotListed {
                target: target.name.clone(),
                provider: p,
                listed: listed(&rt.providers),
            });
        }
        Some(p) => p,
        None => rt.providers.first().copied().unwrap_or(Provider::Cpu),
    };
    let on_gpu = matches!(provider, Provider::Tensorrt | Provider::Cuda) && target.gpu.is_some();
    let mut notes = Vec::new();

    let bpp = precision.bytes_per_param();
    let weights = Item {
        what: "weights",
        bytes: model.parameters * bpp,
        formula: format!("{} parameters x {bpp} B ({precision})", model.parameters),
    };
    let largest = model
        .inputs
        .iter()
        .chain(&model.outputs)
        .max_by_key(|s| model.tensor_bytes(s, 1));
    let (largest_name, largest_bytes) = largest
        .map(|s| (s.name.as_str(), model.tensor_bytes(s, 1)))
        .unwrap_or(("none", 0));
    let activations = Item {
        what: "activations",
        bytes: 2 * largest_bytes * req.batch,
        formula: format!(
            "2 x largest input/output `{largest_name}` ({largest_bytes} B) x batch {}",
            req.batch
        ),
    };
    let graph = model.graph(req.batch);
    let graph_item = graph.as_ref().map(|g| Item {
        what: "graph",
        bytes: g.nodes * NODE_BYTES,
        formula: format!(
            "{} nodes ({} subgraphs) x {} KiB: ONNX Runtime graph, kernels, plans",
            g.nodes,
            g.subgraphs,
            NODE_BYTES / KIB
        ),
    });
    let intermediates = graph.as_ref().map(|g| Item {
        what: "intermediates",
        bytes: ARENA_FACTOR * g.peak_intermediate_bytes,
        formula: format!(
            "{ARENA_FACTOR} x peak of live intermediate tensors ({} B at batch {}{}): first run + memory pattern in the arena",
            g.peak_intermediate_bytes,
            req.batch,
            g.largest_intermediate
                .as_ref()
                .map(|(n, b)| format!("; largest `{n}` {b} B"))
                .unwrap_or_default()
        ),
    });
    // Conv weights as a share of all: from the graph, or all of them when
    // the graph was not read (the larger estimate).
    let conv_params = graph
        .as_ref()
        .map(|g| g.conv_weight_elements.min(model.parameters))
        .unwrap_or(model.parameters);
    let other_params = model.parameters - conv_params;
    let weight_copies = Item {
        what: "weight_copies",
        bytes: (conv_params * CONV_WEIGHT_COPIES_TENTHS + other_params * WEIGHT_COPIES_TENTHS)
            * bpp
            / 10,
        formula: format!(
            "while the session is built: ({conv_params} conv parameters x {:.1} (model file + NCHWc copy) + {other_params} others x {:.1} (model file)) x {bpp} B",
            CONV_WEIGHT_COPIES_TENTHS as f64 / 10.0,
            WEIGHT_COPIES_TENTHS as f64 / 10.0
        ),
    };
    let workspace = (provider == Provider::Tensorrt && on_gpu).then(|| {
        let (bytes, why) = match req.workspace_bytes {
            Some(b) => (b, "--workspace-bytes"),
            None => (
                TRT_WORKSPACE_DEFAULT_BYTES,
                "TensorRT EP default trt_max_workspace_size",
            ),
        };
        Item {
            what: "tensorrt_workspace",
            bytes,
            formula: why.into(),
        }
    });
    let cpu_runtime = Item {
        what: "runtime",
        bytes: CPU_RUNTIME_BYTES,
        formula: "outpost + libonnxruntime + ONNX Runtime environment and threads".into(),
    };
    let host_initializers = Item {
        what: "onnx_initializers",
        bytes: model.parameters * 4,
        formula: format!(
            "{} parameters x 4 B: the ONNX weights ONNX Runtime keeps on the host",
            model.parameters
        ),
    };

    let mut pools = Vec::new();
    let mut runtime_overhead = CPU_RUNTIME_BYTES + graph_item.as_ref().map_or(0, |g| g.bytes);
    if !on_gpu {
        let mut items = vec![cpu_runtime];
        items.extend(graph_item.clone());
        items.extend([weights.clone(), weight_copies, activations.clone()]);
        items.extend(intermediates.clone());
        pools.push(Pool::new("host", target.memory.usable_bytes, items));
    } else if target.memory.shared_with_gpu {
        runtime_overhead += JETSON_GPU_RUNTIME_BYTES;
        let mut items = vec![cpu_runtime];
        items.extend(graph_item.clone());
        items.extend([
            Item {
                what: "gpu_runtime",
                bytes: JETSON_GPU_RUNTIME_BYTES,
                formula: "CUDA context + cuDNN + TensorRT libraries in the shared pool".into(),
            },
            host_initializers,
            weights.clone(),
            activations.clone(),
        ]);
        items.extend(intermediates.clone());
        items.extend(workspace.clone());
        pools.push(Pool::new("shared", target.memory.usable_bytes, items));
        notes.push(
            "Jetson: CPU and GPU share one pool, so host and device items add up in it".into(),
        );
    } else {
        runtime_overhead += CUDA_CONTEXT_BYTES + GPU_HOST_LIBS_BYTES;
        let mut host = vec![cpu_runtime];
        host.extend(graph_item.clone());
        host.extend([
            Item {
                what: "gpu_libraries",
                bytes: GPU_HOST_LIBS_BYTES,
                formula: "CUDA, cuDNN, cuBLAS, TensorRT libraries resident in the host process"
                    .into(),
            },
            host_initializers,
        ]);
        pools.push(Pool::new("host", target.memory.usable_bytes, host));
        let mut items = vec![
            Item {
                what: "cuda_context",
                bytes: CUDA_CONTEXT_BYTES,
                formula: "CUDA context + cuDNN/cuBLAS handles (300-500 MB)".into(),
            },
            weights.clone(),
            activations.clone(),
        ];
        items.extend(intermediates.clone());
        items.extend(workspace.clone());
        let gpu_mem = target.gpu.as_ref().map(|g| g.memory_bytes).unwrap_or(0);
        pools.push(Pool::new("gpu", gpu_mem, items));
    }
    if precision != Precision::Fp32 {
        notes.push(format!(
            "{precision} assumes {}",
            match (precision, on_gpu) {
                (Precision::Int8, true) =>
                    "a TensorRT int8 engine (calibration table) or a quantized QDQ model",
                (Precision::Int8, false) => "a quantized (QDQ / QOperator) export of the model",
                (_, true) => "TensorRT builds the engine at that precision",
                (_, false) => "a model exported at that precision",
            }
        ));
    }
    let unresolved: Vec<&str> = model
        .inputs
        .iter()
        .chain(&model.outputs)
        .flat_map(|s| &s.shape)
        .filter_map(|d| match d {
            Dim::Symbolic(n)
                if !crate::backend::is_batch_name(n) && !model.dim_sizes.contains_key(n) =>
            {
                Some(n.as_str())
            }
            _ => None,
        })
        .collect();
    if !unresolved.is_empty() {
        notes.push(format!(
            "free dimensions counted as 1: {}",
            unresolved.join(", ")
        ));
    }
    if !model.dim_sizes.is_empty() {
        notes.push(format!(
            "free dimensions from the manifest's preprocessing: {}",
            model
                .dim_sizes
                .iter()
                .map(|(k, v)| format!("{k} = {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    match &graph {
        None => notes.push(
            "the graph was not read: intermediates not counted, every weight taken as a conv weight".into(),
        ),
        Some(g) if g.unknown_shapes > 0 => notes.push(format!(
            "{} node outputs of unknown shape counted as large as their largest activation input",
            g.unknown_shapes
        )),
        Some(_) => {}
    }
    if on_gpu {
        notes.push(
            "intermediates on a GPU provider use the CPU rule at the model's own dtypes (not measured on GPU)".into(),
        );
    }
    let verdict = pools
        .iter()
        .map(|p| p.verdict)
        .max()
        .unwrap_or(Verdict::Fits);
    let headroom_bytes = pools.iter().map(|p| p.headroom_bytes).min().unwrap_or(0);
    let workspace_bytes = workspace.map(|w| w.bytes).unwrap_or(0);
    let total_bytes = pools.iter().map(|p| p.used_bytes).sum();
    Ok(Plan {
        model: model.name.clone(),
        model_path: model.path.display().to_string(),
        target: target.name.clone(),
        precision,
        provider,
        batch: req.batch,
        parameters: model.parameters,
        model_file_bytes: model.file_bytes,
        weights_bytes: weights.bytes,
        activations_bytes: activations.bytes,
        intermediates_bytes: intermediates.map_or(0, |i| i.bytes),
        workspace_bytes,
        runtime_overhead_bytes: runtime_overhead,
        total_bytes,
        pools,
        verdict,
        headroom_bytes,
        graph,
        notes,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use super::*;
    use crate::backend::{DType, IoSpec};

    fn target(name: &str) -> Target {
        let p = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .join("targets")
            .join(format!("{name}.toml"));
        Target::load(&p).unwrap()
    }

    fn facts(params: u64) -> ModelFacts {
        ModelFacts {
            name: "m".into(),
            path: "m.onnx".into(),
            file_bytes: params * 4,
            parameters: params,
            inputs: vec![IoSpec {
                name: "input".into(),
                dtype: DType::F32,
                shape: vec![
                    Dim::Symbolic("batch".into()),
                    Dim::Fixed(3),
                    Dim::Fixed(224),
                    Dim::Fixed(224),
                ],
            }],
            outputs: vec![IoSpec {
                name: "logits".into(),
                dtype: DType::F32,
                shape: vec![Dim::Symbolic("batch".into()), Dim::Fixed(1000)],
            }],
            io_from: "manifest",
            dim_sizes: BTreeMap::new(),
            onnx: None,
        }
    }

    fn req(precision: Option<Precision>) -> PlanRequest {
        PlanRequest {
            precision,
            provider: None,
            batch: 1,
            workspace_bytes: None,
        }
    }

    #[test]
    fn cpu_target_weights_and_activations() {
        let p = plan(&facts(1000), &target("x86_64-cpu"), &req(None)).unwrap();
        assert_eq!(p.precision, Precision::Fp32);
        assert_eq!(p.provider, Provider::Cpu);
        assert_eq!(p.weights_bytes, 4000);
        assert_eq!(p.activations_bytes, 2 * 3 * 224 * 224 * 4);
        assert_eq!(p.workspace_bytes, 0);
        assert_eq!(p.pools.len(), 1);
        // No file to walk: no graph items, every weight taken as a conv weight.
        assert_eq!(p.intermediates_bytes, 0);
        assert_eq!(
            p.total_bytes,
            CPU_RUNTIME_BYTES + 4000 + 4000 * CONV_WEIGHT_COPIES_TENTHS / 10 + 2 * 602_112
        );
        assert_eq!(p.verdict, Verdict::Fits);
    }

    /// A conv net whose intermediate tensors dwarf its input and output: the
    /// plan counts them from the graph (twice, for the arena), scales them
    /// with the batch, and counts conv weights with their reordered copy.
    #[test]
    fn cpu_estimate_walks_the_graph_of_a_conv_net() {
        use graph::build::G;
        let onnx = G::new("x", "y")
            .conv("x", "c1", 3, 32, 3, 1)
            .op("Relu", &["c1"], "r1")
            .conv("r1", "c2", 32, 32, 3, 1)
            .op("Relu", &["c2"], "r2")
            .op("GlobalAveragePool", &["r2"], "p")
            .op("Flatten", &["p"], "f")
            .gemm("f", "y", 32, 10)
            .bytes();
        let info = crate::model::onnx::inspect_bytes(onnx.clone()).unwrap();
        let conv_params = 32 * 3 * 9 + 32 * 32 * 9;
        assert_eq!(info.parameters, conv_params + 10 * 32);
        let m = ModelFacts {
            name: "convnet".into(),
            path: "convnet.onnx".into(),
            file_bytes: onnx.len() as u64,
            parameters: info.parameters,
            inputs: vec![IoSpec {
                name: "x".into(),
                dtype: DType::F32,
                shape: vec![
                    Dim::Symbolic("batch".into()),
                    Dim::Fixed(3),
                    Dim::Fixed(64),
                    Dim::Fixed(64),
                ],
            }],
            outputs: vec![IoSpec {
                name: "y".into(),
                dtype: DType::F32,
                shape: vec![Dim::Symbolic("batch".into()), Dim::Fixed(10)],
            }],
            io_from: "manifest",
            dim_sizes: BTreeMap::new(),
            onnx: Some(onnx),
        };
        let cpu = target("x86_64-cpu");
        let p1 = plan(&m, &cpu, &req(None)).unwrap();
        let g = p1.graph.as_ref().expect("graph walked");
        assert_eq!(g.nodes, 7);
        assert_eq!(g.unknown_shapes, 0);
        // Two 32 x 64 x 64 f32 maps alive at once (a Relu's input and output).
        assert_eq!(g.peak_intermediate_bytes, 2 * 32 * 64 * 64 * 4);
        assert_eq!(
            p1.intermediates_bytes,
            ARENA_FACTOR * g.peak_intermediate_bytes
        );
        // The IO rule alone (the old estimate) sees 2 x the input: far less.
        assert_eq!(p1.activations_bytes, 2 * 3 * 64 * 64 * 4);
        assert!(p1.intermediates_bytes > 10 * p1.activations_bytes);
        let item = |p: &Plan, what: &str| {
            p.pools[0]
                .items
                .iter()
                .find(|i| i.what == what)
                .map(|i| i.bytes)
                .unwrap_or_else(|| panic!("no {what} item"))
        };
        assert_eq!(
            item(&p1, "weight_copies"),
            (conv_params * CONV_WEIGHT_COPIES_TENTHS + 320 * WEIGHT_COPIES_TENTHS) * 4 / 10
        );
        assert_eq!(item(&p1, "graph"), 7 * NODE_BYTES);
        assert_eq!(
            p1.total_bytes,
            p1.pools[0].items.iter().map(|i| i.bytes).sum::<u64>()
        );
        // Batch 4: four times the intermediates and IO, the rest unchanged.
        let p4 = plan(
            &m,
            &cpu,
            &PlanRequest {
                batch: 4,
                ..req(None)
            },
        )
        .unwrap();
        assert_eq!(p4.intermediates_bytes, 4 * p1.intermediates_bytes);
        assert_eq!(
            p4.total_bytes - p1.total_bytes,
            3 * (p1.intermediates_bytes + p1.activations_bytes)
        );
    }

    #[test]
    fn image_preprocessing_sizes_free_dimensions() {
        let mut m = facts(1000);
        m.outputs[0].shape[1] = Dim::Fixed(2);
        m.inputs[0].shape[2] = Dim::Symbolic("height".into());
        m.inputs[0].shape[3] = Dim::Symbolic("width".into());
        let p = plan(&m, &target("x86_64-cpu"), &req(None)).unwrap();
        assert_eq!(p.activations_bytes, 2 * 3 * 4);
        assert!(
            p.notes
                .iter()
                .any(|n| n.contains("counted as 1: height, width"))
        );
        m.dim_sizes = BTreeMap::from([("height".into(), 736), ("width".into(), 640)]);
        let p = plan(&m, &target("x86_64-cpu"), &req(None)).unwrap();
        assert_eq!(p.activations_bytes, 2 * 3 * 736 * 640 * 4);
    }

    #[test]
    fn refuses_a_precision_the_target_does_not_list() {
        let e = plan(
            &facts(1000),
            &target("x86_64-cpu"),
            &req(Some(Precision::Fp16)),
        )
        .unwrap_err();
        assert!(matches!(e, PlanError::PrecisionNotListed { .. }), "{e}");
        assert!(e.to_string().contains("fp32, int8"), "{e}");
        let xavier = target("jetson-agx-xavier-32gb");
        assert!(plan(&facts(1), &xavier, &req(Some(Precision::Bf16))).is_err());
    }

    #[test]
    fn jetson_is_one_shared_pool_with_workspace() {
        let p = plan(
            &facts(1_000_000),
            &target("jetson-orin-nano-8gb"),
            &req(None),
        )
        .unwrap();
        assert_eq!(p.precision, Precision::Fp16);
        assert_eq!(p.provider, Provider::Tensorrt);
        assert_eq!(p.weights_bytes, 2_000_000);
        assert_eq!(p.workspace_bytes, TRT_WORKSPACE_DEFAULT_BYTES);
        assert_eq!(p.pools.len(), 1);
        assert_eq!(p.pools[0].name, "shared");
    }

    #[test]
    fn dgpu_has_host_and_device_pools() {
        let p = plan(
            &facts(1_000_000),
            &target("x86_64-nvidia"),
            &req(Some(Precision::Int8)),
        )
        .unwrap();
        let names: Vec<_> = p.pools.iter().map(|p| p.name).collect();
        assert_eq!(names, ["host", "gpu"]);
        assert_eq!(p.weights_bytes, 1_000_000);
        assert_eq!(p.pools[1].capacity_bytes, 17_179_869_184);
    }

    #[test]
    fn verdict_thresholds() {
        assert_eq!(Verdict::of(80, 100), Verdict::Fits);
        assert_eq!(Verdict::of(81, 100), Verdict::Tight);
        assert_eq!(Verdict::of(100, 100), Verdict::Tight);
        assert_eq!(Verdict::of(101, 100), Verdict::DoesNotFit);
    }

    #[test]
    fn a_huge_model_does_not_fit_on_orin_nano() {
        // 3 B parameters at fp16 = 6 GB > 5.5 GiB usable.
        let p = plan(
            &facts(3_000_000_000),
            &target("jetson-orin-nano-8gb"),
            &req(None),
        )
        .unwrap();
        assert_eq!(p.verdict, Verdict::DoesNotFit);
        assert!(p.headroom_bytes < 0);
    }
}
