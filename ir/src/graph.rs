//! `Graph`: values and nodes in arenas with typed ids, in program order.
//!
//! Values are defined by exactly one of: a graph input, a parameter, or a node output. Nodes are
//! stored in a valid execution order (every input defined before its use). A graph built by
//! appending (the frontend, the parser, every pass) is canonical: its value arena is in
//! definition order (inputs, parameters, node outputs), which is the order the printer numbers.

use std::collections::BTreeMap;

use crate::{Mesh, Op, Placement, TensorType};

#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl ValueId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Where a value comes from.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Def {
    /// The i-th graph input (fed data).
    Input(usize),
    /// The i-th parameter (a trainable weight, loaded from the model's weights).
    Param(usize),
    /// The i-th state value: persistent across steps, zero at the start (optimizer moments).
    State(usize),
    /// Output `index` of a node.
    Node(NodeId, usize),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    /// Inputs and parameters carry their model name; other values may be unnamed.
    pub name: Option<String>,
    pub ty: TensorType,
    /// One placement per mesh axis.
    pub placements: Vec<Placement>,
    pub def: Def,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
}

/// A fusion group: consecutive nodes that codegen computes as one generated kernel (the
/// `fusion` pass makes them; the text format prints them as a `fusion "name" { ... }` block).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fusion {
    pub name: String,
    /// The group's nodes, by index in execution order.
    pub nodes: std::ops::Range<usize>,
}

impl Fusion {
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes.clone().map(|n| NodeId(n as u32))
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Graph {
    pub name: String,
    pub mesh: Mesh,
    values: Vec<Value>,
    nodes: Vec<Node>,
    inputs: Vec<ValueId>,
    params: Vec<ValueId>,
    states: Vec<ValueId>,
    outputs: Vec<(String, ValueId)>,
    /// After a run, each target (a parameter or state) takes the value: a training step's
    /// parameter and optimizer-state updates.
    updates: Vec<(ValueId, ValueId)>,
    /// Fusion groups, in node order, not overlapping. A graph built anew (a `Rewriter`, dead
    /// code removal) has none: fusion is the last pass.
    fusions: Vec<Fusion>,
}

impl Graph {
    pub fn new(name: impl Into<String>) -> Graph {
        Graph { name: name.into(), ..Graph::default() }
    }

    fn push_value(&mut self, name: Option<String>, ty: TensorType, def: Def) -> ValueId {
        let id = ValueId(self.values.len() as u32);
        let placements = self.mesh.replicated();
        self.values.push(Value { name, ty, placements, def });
        id
    }

    pub fn add_input(&mut self, name: impl Into<String>, ty: TensorType) -> ValueId {
        let id = self.push_value(Some(name.into()), ty, Def::Input(self.inputs.len()));
        self.inputs.push(id);
        id
    }

    pub fn add_param(&mut self, name: impl Into<String>, ty: TensorType) -> ValueId {
        let id = self.push_value(Some(name.into()), ty, Def::Param(self.params.len()));
        self.params.push(id);
        id
    }

    pub fn add_state(&mut self, name: impl Into<String>, ty: TensorType) -> ValueId {
        let id = self.push_value(Some(name.into()), ty, Def::State(self.states.len()));
        self.states.push(id);
        id
    }

    /// Records that after a run `target` (a parameter or state) takes `value`.
    pub fn add_update(&mut self, target: ValueId, value: ValueId) {
        self.updates.push((target, value));
    }

    /// Appends a node whose output types are already known (the parser, rewrites).
    pub fn add_node_typed(&mut self, op: Op, inputs: Vec<ValueId>, output_types: Vec<TensorType>) -> NodeId {
        let node = NodeId(self.nodes.len() as u32);
        let outputs =
            output_types.into_iter().enumerate().map(|(i, ty)| self.push_value(None, ty, Def::Node(node, i))).collect();
        self.nodes.push(Node { op, inputs, outputs });
        node
    }

    /// Appends a node, inferring its output types from the op's rule.
    pub fn add_node(&mut self, op: Op, inputs: Vec<ValueId>, num_outputs: usize) -> Result<NodeId, String> {
        let types: Vec<&TensorType> = inputs.iter().map(|&v| &self.values[v.index()].ty).collect();
        let out = op.infer(&types, num_outputs)?;
        Ok(self.add_node_typed(op, inputs, out))
    }

    /// Appends a single-output node and returns its output.
    pub fn add(&mut self, op: Op, inputs: Vec<ValueId>) -> Result<ValueId, String> {
        let node = self.add_node(op, inputs, 1)?;
        Ok(self.nodes[node.index()].outputs[0])
    }

    pub fn add_output(&mut self, name: impl Into<String>, value: ValueId) {
        self.outputs.push((name.into(), value));
    }

    pub fn value(&self, id: ValueId) -> &Value {
        &self.values[id.index()]
    }

    pub fn value_mut(&mut self, id: ValueId) -> &mut Value {
        &mut self.values[id.index()]
    }

    pub fn ty(&self, id: ValueId) -> &TensorType {
        &self.values[id.index()].ty
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    pub fn nodes(&self) -> impl ExactSizeIterator<Item = (NodeId, &Node)> {
        self.nodes.iter().enumerate().map(|(i, n)| (NodeId(i as u32), n))
    }

    pub fn values(&self) -> impl ExactSizeIterator<Item = (ValueId, &Value)> {
        self.values.iter().enumerate().map(|(i, v)| (ValueId(i as u32), v))
    }

    pub fn num_values(&self) -> usize {
        self.values.len()
    }

    /// Each value's readers, in graph order (a node reading a value twice is listed twice).
    pub fn consumers(&self) -> Vec<Vec<NodeId>> {
        let mut consumers = vec![Vec::new(); self.values.len()];
        for (id, node) in self.nodes() {
            for v in &node.inputs {
                consumers[v.index()].push(id);
            }
        }
        consumers
    }

    pub fn num_nodes(&self) -> usize {
        self.nodes.len()
    }

    pub fn inputs(&self) -> &[ValueId] {
        &self.inputs
    }

    pub fn params(&self) -> &[ValueId] {
        &self.params
    }

    pub fn outputs(&self) -> &[(String, ValueId)] {
        &self.outputs
    }

    pub fn states(&self) -> &[ValueId] {
        &self.states
    }

    pub fn fusions(&self) -> &[Fusion] {
        &self.fusions
    }

    /// Makes nodes `nodes` one fusion group named `name` (checked by the verifier).
    pub fn add_fusion(&mut self, name: impl Into<String>, nodes: std::ops::Range<usize>) {
        self.fusions.push(Fusion { name: name.into(), nodes });
    }

    pub fn updates(&self) -> &[(ValueId, ValueId)] {
        &self.updates
    }

    /// The value's name if it has one.
    pub fn name_of(&self, id: ValueId) -> Option<&str> {
        self.values[id.index()].name.as_deref()
    }

    /// A copy with only the nodes that outputs and pipeline sends depend on and only the
    /// parameters they read, in canonical order. Inputs are all kept: they are the graph's calling convention.
    pub fn without_dead_code(&self) -> Graph {
        let mut live = vec![false; self.values.len()];
        for (_, v) in &self.outputs {
            live[v.index()] = true;
        }
        for (target, value) in &self.updates {
            live[target.index()] = true;
            live[value.index()] = true;
        }
        let mut node_live = vec![false; self.nodes.len()];
        for (i, node) in self.nodes.iter().enumerate().rev() {
            if node.outputs.iter().any(|o| live[o.index()]) || matches!(node.op, Op::Send { .. }) {
                node_live[i] = true;
                for v in &node.inputs {
                    live[v.index()] = true;
                }
            }
        }
        let mut rw = Rewriter::new(self, |p| live[p.index()]);
        // States are kept even if unread: they are the step's persistent memory.
        for (id, _) in self.nodes() {
            if node_live[id.index()] {
                rw.copy_node(id);
            }
        }
        rw.finish()
    }

    /// Number of uses of each value by nodes and graph outputs.
    pub fn use_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.values.len()];
        for node in &self.nodes {
            for v in &node.inputs {
                counts[v.index()] += 1;
            }
        }
        for (_, v) in &self.outputs {
            counts[v.index()] += 1;
        }
        for (_, v) in &self.updates {
            counts[v.index()] += 1;
        }
        counts
    }
}

/// Builds a new canonical graph from an old one, node by node: copy a node, replace it by
/// another op, or drop it. Values are mapped from old ids to new ones; names and placements
/// travel with copied values.
pub struct Rewriter<'g> {
    old: &'g Graph,
    new: Graph,
    map: Vec<Option<ValueId>>,
}

impl<'g> Rewriter<'g> {
    /// Starts a rewrite with all inputs and the parameters `keep_param` accepts.
    pub fn new(old: &'g Graph, keep_param: impl Fn(ValueId) -> bool) -> Rewriter<'g> {
        Rewriter::replacing_params(old, keep_param, &BTreeMap::new()).0
    }

    /// Starts a rewrite as [`Rewriter::new`] does, where each parameter in `replace` gives way
    /// to new parameters (name and type) in its place in the parameter order. Returns their
    /// ids, by the parameter they replace.
    pub fn replacing_params(
        old: &'g Graph,
        keep_param: impl Fn(ValueId) -> bool,
        replace: &BTreeMap<ValueId, Vec<(String, TensorType)>>,
    ) -> (Rewriter<'g>, BTreeMap<ValueId, Vec<ValueId>>) {
        let mut new = Graph { name: old.name.clone(), mesh: old.mesh.clone(), ..Graph::default() };
        let mut map = vec![None; old.values.len()];
        for &i in &old.inputs {
            let v = &old.values[i.index()];
            let id = new.add_input(v.name.clone().unwrap_or_default(), v.ty.clone());
            new.values[id.index()].placements = v.placements.clone();
            map[i.index()] = Some(id);
        }
        let mut replaced = BTreeMap::new();
        for &p in old.params.iter().filter(|&&p| keep_param(p)) {
            if let Some(parts) = replace.get(&p) {
                let ids = parts.iter().map(|(name, ty)| new.add_param(name.clone(), ty.clone())).collect();
                replaced.insert(p, ids);
                continue;
            }
            let v = &old.values[p.index()];
            let id = new.add_param(v.name.clone().unwrap_or_default(), v.ty.clone());
            new.values[id.index()].placements = v.placements.clone();
            map[p.index()] = Some(id);
        }
        for &st in &old.states {
            let v = &old.values[st.index()];
            let id = new.add_state(v.name.clone().unwrap_or_default(), v.ty.clone());
            new.values[id.index()].placements = v.placements.clone();
            map[st.index()] = Some(id);
        }
        (Rewriter { old, new, map }, replaced)
    }

    /// The new id of an old value; it must have been copied or replaced already.
    pub fn map(&self, old: ValueId) -> ValueId {
        self.map[old.index()].expect("value mapped before its use")
    }

    /// The new id of an old value, if it has been copied or replaced.
    pub fn mapped(&self, old: ValueId) -> Option<ValueId> {
        self.map[old.index()]
    }

    /// The graph being rewritten.
    pub fn old(&self) -> &'g Graph {
        self.old
    }

    /// The graph being built.
    pub fn graph(&mut self) -> &mut Graph {
        &mut self.new
    }

    /// Copies an old node unchanged.
    pub fn copy_node(&mut self, id: NodeId) {
        let node = &self.old.nodes[id.index()];
        let inputs = node.inputs.iter().map(|&v| self.map(v)).collect();
        let types = node.outputs.iter().map(|v| self.old.values[v.index()].ty.clone()).collect();
        let new = self.new.add_node_typed(node.op.clone(), inputs, types);
        for (i, &old_out) in node.outputs.iter().enumerate() {
            let new_out = self.new.nodes[new.index()].outputs[i];
            let v = &self.old.values[old_out.index()];
            self.new.values[new_out.index()].name = v.name.clone();
            self.new.values[new_out.index()].placements = v.placements.clone();
            self.map[old_out.index()] = Some(new_out);
        }
    }

    /// Makes an old value stand for a new one (the output of a replacement).
    pub fn set(&mut self, old: ValueId, new: ValueId) {
        self.map[old.index()] = Some(new);
    }

    /// Finishes with the old graph's updates (mapped) but no outputs; the caller adds its own.
    pub fn finish_without_outputs(mut self) -> Graph {
        for (target, value) in &self.old.updates {
            let (t, v) = (self.map(*target), self.map(*value));
            self.new.updates.push((t, v));
        }
        self.new
    }

    /// Finishes with the old graph's outputs and updates, mapped.
    pub fn finish(self) -> Graph {
        let outputs: Vec<(String, ValueId)> =
            self.old.outputs.iter().map(|(name, v)| (name.clone(), self.map(*v))).collect();
        let mut graph = self.finish_without_outputs();
        graph.outputs = outputs;
        graph
    }
}
