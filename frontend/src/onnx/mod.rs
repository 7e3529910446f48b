//! ONNX import: memory-map the model, decode it with prost, bind symbolic dims, and convert
//! node by node into the IR. Every node whose inputs are all constant is evaluated on the spot
//! with the IR's reference evaluator, which folds the shape arithmetic PyTorch exports
//! (Shape/Gather/Concat/Reshape chains, masks) so the resulting graph is fully static.
//! Float initializers are the parameters, but for buffers PyTorch does not train (see
//! `is_constant_initializer`), which are constants and fold like the rest.
//! [`export`] goes the other way for weights: trained tensors written back into the model.

pub mod export;
mod ops;
pub mod proto;
pub mod tensor;

use std::collections::BTreeMap;
use std::path::Path;

use autotp_ir::{Graph, Op, Tensor, TensorType, ValueId};
use bytes::Bytes;
use prost::Message;

use crate::{FrontendError, ImportOptions, Model};
pub use ops::SUPPORTED_OPS;
use proto::{type_proto, ModelProto, NodeProto};
pub use tensor::dtype_from_onnx;

/// The opsets of the default domain this importer supports.
pub const OPSETS: std::ops::RangeInclusive<i64> = 13..=28;

/// A value during import: a constant known at compile time, or a graph value.
#[derive(Clone, Debug)]
enum Sym {
    Const(Tensor),
    Value(ValueId),
}

/// The node being converted, for error messages.
struct NodeCx<'n> {
    node: &'n NodeProto,
    opset: i64,
}

impl NodeCx<'_> {
    fn invalid(&self, message: impl Into<String>) -> FrontendError {
        FrontendError::InvalidNode {
            op_type: self.node.op_type.clone(),
            node: self.node.name.clone(),
            message: message.into(),
        }
    }
}

/// Results of an all-constant op are folded when no output has more elements than this; a
/// bigger result (an attention mask at a long sequence) stays an op over its small inputs, so the
/// IR stays readable and the model small.
const FOLD_LIMIT: usize = 1 << 16;

/// Identifies a constant: small ones by value (the same scalar in every layer is one node),
/// large ones by the identity of their bytes.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
enum ConstKey {
    Value(String, Vec<u8>),
    Identity(String, usize, usize),
}

impl ConstKey {
    fn of(t: &Tensor) -> ConstKey {
        if t.bytes().len() <= 256 {
            ConstKey::Value(t.ty.to_string(), t.bytes().to_vec())
        } else {
            ConstKey::Identity(t.ty.to_string(), t.bytes().as_ptr() as usize, t.bytes().len())
        }
    }
}

struct Importer {
    graph: Graph,
    env: BTreeMap<String, Sym>,
    /// Tensor sequences (`SplitToSequence`, `SequenceConstruct`): their items, each known at
    /// import, by name. Only the sequence ops read them.
    sequences: BTreeMap<String, Vec<Sym>>,
    /// Constant nodes already in the graph, so a constant used in many places is one node.
    materialized: BTreeMap<ConstKey, ValueId>,
}

impl Importer {
    fn ty(&self, sym: &Sym) -> TensorType {
        match sym {
            Sym::Const(t) => t.ty.clone(),
            Sym::Value(v) => self.graph.ty(*v).clone(),
        }
    }

    fn value_of(&mut self, sym: &Sym) -> ValueId {
        match sym {
            Sym::Value(v) => *v,
            Sym::Const(t) => {
                let key = ConstKey::of(t);
                if let Some(&v) = self.materialized.get(&key) {
                    return v;
                }
                let v = self.graph.add(Op::Constant { value: t.clone() }, vec![]).expect("constants always type-check");
                self.materialized.insert(key, v);
                v
            }
        }
    }

    /// Adds `op`, or evaluates it when every input is a constant.
    fn emit(&mut self, cx: &NodeCx, op: Op, inputs: &[Sym], num_outputs: usize) -> Result<Vec<Sym>, FrontendError> {
        let consts: Option<Vec<&Tensor>> =
            inputs.iter().map(|s| if let Sym::Const(t) = s { Some(t) } else { None }).collect();
        if let Some(consts) = consts {
            let types: Vec<&TensorType> = consts.iter().map(|t| &t.ty).collect();
            let out_types = op.infer(&types, num_outputs).map_err(|m| cx.invalid(m))?;
            if out_types.iter().all(|t| t.numel() <= FOLD_LIMIT) {
                let outs =
                    autotp_ir::eval::eval_op(&op, &consts, num_outputs).map_err(|e| cx.invalid(e.to_string()))?;
                return Ok(outs.into_iter().map(Sym::Const).collect());
            }
        }
        let ids: Vec<ValueId> = inputs.iter().map(|s| self.value_of(s)).collect();
        let node = self.graph.add_node(op, ids, num_outputs).map_err(|m| cx.invalid(m))?;
        Ok(self.graph.node(node).outputs.iter().map(|&v| Sym::Value(v)).collect())
    }

    fn emit1(&mut self, cx: &NodeCx, op: Op, inputs: &[Sym]) -> Result<Sym, FrontendError> {
        Ok(self.emit(cx, op, inputs, 1)?.remove(0))
    }

    fn lookup(&self, cx: &NodeCx, name: &str) -> Result<Sym, FrontendError> {
        if self.sequences.contains_key(name) {
            return Err(cx.invalid(format!("input '{name}' is a tensor sequence; only the sequence ops read one")));
        }
        self.env.get(name).cloned().ok_or_else(|| {
            cx.invalid(format!("input '{name}' is not produced by any earlier node, input or initializer"))
        })
    }

    fn lookup_sequence(&self, cx: &NodeCx, name: &str) -> Result<&[Sym], FrontendError> {
        self.sequences
            .get(name)
            .map(Vec::as_slice)
            .ok_or_else(|| cx.invalid(format!("input '{name}' is not a tensor sequence made by an earlier node")))
    }
}

/// A model file's protobuf, undecoded tensors and all.
fn read_model(path: &Path) -> Result<ModelProto, FrontendError> {
    ModelProto::decode(map_file(path)?)
        .map_err(|e| FrontendError::Decode { path: path.to_path_buf(), message: e.to_string() })
}

/// The names of a model's graph inputs that are not initializers, in order.
pub fn input_names(path: &Path) -> Result<Vec<String>, FrontendError> {
    let model = read_model(path)?;
    let graph = model.graph.unwrap_or_default();
    let initializers: std::collections::BTreeSet<&str> = graph.initializer.iter().map(|t| t.name.as_str()).collect();
    Ok(graph.input.iter().filter(|i| !initializers.contains(i.name.as_str())).map(|i| i.name.clone()).collect())
}

/// A model file's `metadata_props`, key to value.
pub fn metadata(path: &Path) -> Result<std::collections::BTreeMap<String, String>, FrontendError> {
    Ok(read_model(path)?.metadata_props.into_iter().map(|p| (p.key, p.value)).collect())
}

/// Reads and imports an ONNX model file.
pub fn import_file(path: &Path, options: &ImportOptions) -> Result<Model, FrontendError> {
    import_bytes(map_file(path)?, path, options)
}

fn map_file(path: &Path) -> Result<Bytes, FrontendError> {
    let io_error = |source| FrontendError::Io { path: path.to_path_buf(), source };
    let file = std::fs::File::open(path).map_err(io_error)?;
    // SAFETY: read-only map; the model must not be truncated while it is imported.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_error)?;
    Ok(Bytes::from_owner(map))
}

/// Imports a model from its serialized bytes; `path` names it in errors and locates external
/// data.
pub fn import_bytes(bytes: Bytes, path: &Path, options: &ImportOptions) -> Result<Model, FrontendError> {
    let decode_error = |message: String| FrontendError::Decode { path: path.to_path_buf(), message };
    if bytes.is_empty() {
        return Err(decode_error("the file is empty".into()));
    }
    let file_bytes = bytes.clone();
    let model = ModelProto::decode(bytes).map_err(|e| decode_error(e.to_string()))?;
    let graph = model.graph.as_ref().ok_or_else(|| decode_error("it has no graph".into()))?;
    let mut opset = None;
    for o in &model.opset_import {
        match o.domain.as_str() {
            "" | "ai.onnx" => opset = Some(o.version),
            // Training-preview ops are not imported; other domains fail on their first node.
            _ => {}
        }
    }
    let opset = opset.ok_or_else(|| decode_error("it imports no opset of the default domain".into()))?;
    if !OPSETS.contains(&opset) {
        return Err(FrontendError::UnsupportedOpset {
            path: path.to_path_buf(),
            domain: "ai.onnx".into(),
            version: opset,
        });
    }

    let name = if graph.name.is_empty() {
        path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
    } else {
        graph.name.clone()
    };
    let mut imp = Importer {
        graph: Graph::new(name),
        env: BTreeMap::new(),
        sequences: BTreeMap::new(),
        materialized: BTreeMap::new(),
    };
    let mut external = tensor::ExternalFiles::new(path);

    // Initializers are parameters (with `shapes_only`, their data is not read) or constants.
    let buffers: std::collections::BTreeSet<&str> = model
        .metadata_props
        .iter()
        .filter(|p| p.key == crate::BUFFERS_METADATA)
        .flat_map(|p| p.value.split(',').map(str::trim).filter(|name| !name.is_empty()))
        .collect();
    let is_parameter = |name: &str, ty: &TensorType| is_parameter(name, ty) && !buffers.contains(name);
    let mut initializers = BTreeMap::new();
    let mut params = Vec::new();
    for t in &graph.initializer {
        let ty = tensor::type_of(t, &t.name)?;
        if options.shapes_only && is_parameter(&t.name, &ty) {
            params.push((t.name.clone(), ty, None));
            continue;
        }
        let tensor = tensor::decode(t, &t.name, &mut external)?;
        if is_parameter(&t.name, &tensor.ty) {
            params.push((t.name.clone(), tensor.ty.clone(), Some(tensor)));
        } else {
            initializers.insert(t.name.clone(), tensor);
        }
    }
    for input in &graph.input {
        if initializers.contains_key(&input.name) || params.iter().any(|(name, _, _)| name == &input.name) {
            continue;
        }
        let ty = input_type(input, options)?;
        let exported_without_params = options.shapes_only && !options.input_shapes.contains_key(&input.name);
        let id = if exported_without_params && is_fixed(input) && is_parameter(&input.name, &ty) {
            imp.graph.add_param(input.name.clone(), ty)
        } else {
            imp.graph.add_input(input.name.clone(), ty)
        };
        imp.env.insert(input.name.clone(), Sym::Value(id));
    }
    for name in options.input_shapes.keys() {
        if !graph.input.iter().any(|i| &i.name == name) {
            return Err(FrontendError::Input {
                input: name.clone(),
                message: "is given a shape, but the model has no such input".into(),
            });
        }
    }
    let mut weights = BTreeMap::new();
    for (name, ty, tensor) in params {
        let id = imp.graph.add_param(name.clone(), ty);
        imp.env.insert(name.clone(), Sym::Value(id));
        if let Some(tensor) = tensor {
            weights.insert(name, tensor);
        }
    }
    for (name, tensor) in initializers {
        imp.env.insert(name, Sym::Const(tensor));
    }

    for node in &graph.node {
        let cx = NodeCx { node, opset };
        let outputs = ops::convert(&mut imp, &cx, &mut external)?;
        for (name, sym) in node.output.iter().zip(outputs) {
            if !name.is_empty() {
                imp.env.insert(name.clone(), sym);
            }
        }
    }
    for out in &graph.output {
        if imp.sequences.contains_key(&out.name) {
            return Err(decode_error(format!(
                "graph output '{}' is a tensor sequence, which autotp does not output",
                out.name
            )));
        }
        let sym = imp
            .env
            .get(&out.name)
            .cloned()
            .ok_or_else(|| decode_error(format!("graph output '{}' is not produced by any node", out.name)))?;
        let id = imp.value_of(&sym);
        imp.graph.add_output(out.name.clone(), id);
    }
    let graph = imp.graph.without_dead_code();
    weights.retain(|name, _| graph.params().iter().any(|&p| graph.name_of(p) == Some(name)));
    autotp_ir::verify(&graph)?;
    let metadata = model.metadata_props.iter().map(|p| (p.key.clone(), p.value.clone())).collect();
    let files = std::iter::once((path.to_path_buf(), &file_bytes)).chain(external.mapped());
    let weight_locations = weight_locations(&weights, files.collect());
    Ok(Model { graph, weights, metadata, weight_locations })
}

/// Where each weight's bytes lie in one of `files` (a zero-copy slice of its map), by absolute
/// path; weights the importer copied (typed fields) have none.
fn weight_locations(
    weights: &BTreeMap<String, Tensor>,
    files: Vec<(std::path::PathBuf, &Bytes)>,
) -> BTreeMap<String, crate::WeightLocation> {
    let files: Vec<(std::path::PathBuf, std::ops::Range<usize>)> = (files.into_iter())
        .filter(|(_, bytes)| !bytes.is_empty())
        .filter_map(|(path, bytes)| {
            let start = bytes.as_ptr() as usize;
            Some((std::fs::canonicalize(path).ok()?, start..start + bytes.len()))
        })
        .collect();
    let mut locations = BTreeMap::new();
    for (name, tensor) in weights {
        let bytes = tensor.bytes();
        let (start, end) = (bytes.as_ptr() as usize, bytes.as_ptr() as usize + bytes.len());
        let within = files.iter().find(|(_, range)| range.start <= start && end <= range.end && !bytes.is_empty());
        if let Some((file, range)) = within {
            let offset = (start - range.start) as u64;
            locations.insert(name.clone(), crate::WeightLocation { file: file.clone(), offset });
        }
    }
    locations
}

/// Whether a float initializer is a parameter. Not those PyTorch does not train, so autotp
/// does not either: 0-d tensors
/// (constants `torch.export` lifts, such as a mask's fill value or a norm's epsilon) and the
/// rotary embedding's frequencies (`inv_freq`, a non-persistent buffer that the legacy
/// exporter bakes in and `torch.export` stores as an initializer). Everything else is a
/// parameter; `--freeze` holds others still, and an export names its buffers in the model's
/// metadata (`autotp.buffers`).
fn is_parameter(name: &str, ty: &TensorType) -> bool {
    ty.dtype.is_float() && !ty.shape.is_empty() && name.rsplit('.').next() != Some("inv_freq")
}

/// Whether every dim of a graph input is a fixed size (no symbolic dims).
fn is_fixed(input: &proto::ValueInfoProto) -> bool {
    let dims = match input.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => t.shape.as_ref().map(|s| s.dim.as_slice()).unwrap_or(&[]),
        _ => return false,
    };
    dims.iter().all(|d| matches!(d.value, Some(proto::tensor_shape_proto::dimension::Value::DimValue(_))))
}

/// The static type of a graph input: declared dims, bound symbolic dims, or `--input-shape`.
fn input_type(input: &proto::ValueInfoProto, options: &ImportOptions) -> Result<TensorType, FrontendError> {
    let err = |message: String| FrontendError::Input { input: input.name.clone(), message };
    let tensor = match input.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => t,
        _ => return Err(err("is not a tensor".into())),
    };
    let dtype = dtype_from_onnx(tensor.elem_type)
        .ok_or_else(|| err(format!("has unsupported element type {}", tensor::onnx_type_name(tensor.elem_type))))?;
    let declared = tensor.shape.as_ref().map(|s| s.dim.as_slice()).unwrap_or(&[]);
    if let Some(shape) = options.input_shapes.get(&input.name) {
        if shape.len() != declared.len() {
            return Err(err(format!(
                "is given with {} dims {shape:?}, the model declares {}",
                shape.len(),
                declared.len()
            )));
        }
        for (i, (d, &given)) in declared.iter().zip(shape).enumerate() {
            if let Some(proto::tensor_shape_proto::dimension::Value::DimValue(v)) = d.value {
                if v as usize != given {
                    return Err(err(format!("is given size {given} for dim {i}, the model fixes it to {v}")));
                }
            }
        }
        let ty = TensorType::new(dtype, shape.clone());
        ty.check_limits().map_err(err)?;
        return Ok(ty);
    }
    let mut shape = Vec::with_capacity(declared.len());
    for (i, d) in declared.iter().enumerate() {
        use proto::tensor_shape_proto::dimension::Value;
        let size = match &d.value {
            Some(Value::DimValue(v)) if *v >= 0 => *v as usize,
            other => {
                let symbol = match other {
                    Some(Value::DimParam(p)) => format!("'{p}'"),
                    _ => "an unnamed dim".to_string(),
                };
                let bound = match i {
                    0 => options.batch,
                    1 => options.seq_len,
                    _ => None,
                };
                let flag = match i {
                    0 => "--batch",
                    1 => "--seq-len",
                    _ => "--input-shape",
                };
                bound.ok_or_else(|| {
                    err(format!(
                        "dim {i} is symbolic ({symbol}); give it with {flag} or --input-shape {}=D0,D1,...",
                        input.name
                    ))
                })?
            }
        };
        shape.push(size);
    }
    let ty = TensorType::new(dtype, shape);
    ty.check_limits().map_err(err)?;
    Ok(ty)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::tensor_proto::DataType;

    fn initializer(name: &str, dims: &[i64], values: &[f32]) -> proto::TensorProto {
        proto::TensorProto {
            name: name.into(),
            dims: dims.to_vec(),
            data_type: DataType::Float as i32,
            float_data: values.to_vec(),
            ..Default::default()
        }
    }

    /// `y = x * w * inv_freq + eps`: `w` is a parameter; the rotary frequencies and the 0-d
    /// epsilon are constants that PyTorch does not train (what `torch.export` stores as
    /// initializers).
    #[test]
    fn buffers_and_scalars_are_not_parameters() {
        let node = |op: &str, inputs: [&str; 2], output: &str| proto::NodeProto {
            op_type: op.into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![output.into()],
            ..Default::default()
        };
        let x_type = proto::TypeProto {
            value: Some(proto::type_proto::Value::TensorType(proto::type_proto::Tensor {
                elem_type: DataType::Float as i32,
                shape: Some(proto::TensorShapeProto {
                    dim: vec![proto::tensor_shape_proto::Dimension {
                        value: Some(proto::tensor_shape_proto::dimension::Value::DimValue(2)),
                        ..Default::default()
                    }],
                }),
            })),
            ..Default::default()
        };
        let model = ModelProto {
            ir_version: 8,
            opset_import: vec![proto::OperatorSetIdProto { domain: String::new(), version: 17 }],
            graph: Some(proto::GraphProto {
                name: "buffers".into(),
                node: vec![
                    node("Mul", ["x", "w"], "a"),
                    node("Mul", ["a", "m.rotary_emb.inv_freq"], "b"),
                    node("Add", ["b", "val_3"], "y"),
                ],
                initializer: vec![
                    initializer("w", &[2], &[1.0, 2.0]),
                    initializer("m.rotary_emb.inv_freq", &[2], &[1.0, 0.5]),
                    initializer("val_3", &[], &[1e-5]),
                ],
                input: vec![proto::ValueInfoProto { name: "x".into(), r#type: Some(x_type), ..Default::default() }],
                output: vec![proto::ValueInfoProto { name: "y".into(), ..Default::default() }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let imported =
            import_bytes(model.encode_to_vec().into(), Path::new("buffers.onnx"), &ImportOptions::default()).unwrap();
        let params: Vec<&str> = imported.graph.params().iter().filter_map(|&p| imported.graph.name_of(p)).collect();
        assert_eq!(params, ["w"]);
        assert_eq!(imported.weights.keys().collect::<Vec<_>>(), ["w"]);

        // An export that names `w` a buffer in the metadata: a constant, nothing to train.
        let mut with_buffers = model.clone();
        with_buffers.metadata_props =
            vec![proto::StringStringEntryProto { key: crate::BUFFERS_METADATA.into(), value: "w, other".into() }];
        let imported =
            import_bytes(with_buffers.encode_to_vec().into(), Path::new("buffers.onnx"), &ImportOptions::default())
                .map_err(|e| e.to_string());
        let imported = imported.as_ref().map(|m| (m.graph.params().len(), m.weights.len()));
        assert_eq!(imported, Ok((0, 0)));
    }
}
