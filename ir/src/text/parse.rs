//! The lexer and the parser, which rebuilds a graph by appending, as the frontend does.

use std::collections::BTreeMap;

use crate::{
    AttentionMask, BinaryOp, Collective, DType, GeluApprox, Graph, Mesh, MeshAxis, Message, Op, Placement, ReduceOp,
    Reduction, Tensor, TensorType, UnaryOp, ValueId,
};

use super::print::Attr;

/// A parse error with its 1-based line and column.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}, column {column}: {message}")]
pub struct ParseError {
    pub line: usize,
    pub column: usize,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    /// `%name`, `%"quoted"` (named) or `%12` (anonymous).
    Value {
        name: String,
        anonymous: bool,
    },
    Word(String),
    Number(String),
    Str(String),
    Punct(char),
    Eof,
}

struct Lexer<'a> {
    src: &'a [u8],
    pos: usize,
    line: usize,
    line_start: usize,
}

impl<'a> Lexer<'a> {
    fn error(&self, message: impl Into<String>) -> ParseError {
        ParseError { line: self.line, column: self.pos - self.line_start + 1, message: message.into() }
    }

    fn skip_space(&mut self) {
        while self.pos < self.src.len() {
            match self.src[self.pos] {
                b'\n' => {
                    self.pos += 1;
                    self.line += 1;
                    self.line_start = self.pos;
                }
                b' ' | b'\t' | b'\r' => self.pos += 1,
                b'#' => {
                    while self.pos < self.src.len() && self.src[self.pos] != b'\n' {
                        self.pos += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn take_while(&mut self, f: impl Fn(u8) -> bool) -> String {
        let start = self.pos;
        while self.pos < self.src.len() && f(self.src[self.pos]) {
            self.pos += 1;
        }
        String::from_utf8_lossy(&self.src[start..self.pos]).into_owned()
    }

    fn string(&mut self) -> Result<String, ParseError> {
        self.pos += 1;
        let mut bytes = Vec::new();
        loop {
            match self.src.get(self.pos) {
                None | Some(b'\n') => return Err(self.error("unterminated string")),
                Some(b'"') => {
                    self.pos += 1;
                    return String::from_utf8(bytes).map_err(|_| self.error("string is not UTF-8"));
                }
                Some(b'\\') => {
                    let c = match self.src.get(self.pos + 1) {
                        Some(b'n') => b'\n',
                        Some(&c @ (b'"' | b'\\')) => c,
                        _ => return Err(self.error("unknown escape in string")),
                    };
                    bytes.push(c);
                    self.pos += 2;
                }
                Some(&c) => {
                    bytes.push(c);
                    self.pos += 1;
                }
            }
        }
    }

    fn next(&mut self) -> Result<(Tok, (usize, usize)), ParseError> {
        self.skip_space();
        let at = (self.line, self.pos - self.line_start + 1);
        let Some(&c) = self.src.get(self.pos) else {
            return Ok((Tok::Eof, at));
        };
        let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'.';
        let tok = match c {
            b'%' => {
                self.pos += 1;
                if self.src.get(self.pos) == Some(&b'"') {
                    Tok::Value { name: self.string()?, anonymous: false }
                } else {
                    let name = self.take_while(ident);
                    if name.is_empty() {
                        return Err(self.error("expected a value name after '%'"));
                    }
                    let anonymous = name.bytes().all(|b| b.is_ascii_digit());
                    Tok::Value { name, anonymous }
                }
            }
            b'"' => Tok::Str(self.string()?),
            b'0'..=b'9' | b'-' | b'+' => {
                let start = self.pos;
                self.pos += 1;
                let rest = self.take_while(|c| c.is_ascii_alphanumeric() || c == b'.');
                let mut text = String::from_utf8_lossy(&self.src[start..start + 1]).into_owned() + &rest;
                // Exponent signs: `1e-5`.
                while text.ends_with(['e', 'E']) && matches!(self.src.get(self.pos), Some(b'-' | b'+')) {
                    self.pos += 1;
                    text.push(self.src[self.pos - 1] as char);
                    text += &self.take_while(|c| c.is_ascii_digit());
                }
                Tok::Number(text)
            }
            c if c.is_ascii_alphabetic() || c == b'_' => Tok::Word(self.take_while(ident)),
            b'=' | b',' | b':' | b'[' | b']' | b'{' | b'}' | b'(' | b')' | b'<' | b'>' => {
                self.pos += 1;
                Tok::Punct(c as char)
            }
            other => return Err(self.error(format!("unexpected character '{}'", other as char))),
        };
        Ok((tok, at))
    }
}

struct Parser<'a> {
    lexer: Lexer<'a>,
    tok: Tok,
    at: (usize, usize),
    graph: Graph,
    values: BTreeMap<(bool, String), ValueId>,
}

impl<'a> Parser<'a> {
    fn error_at(&self, message: impl Into<String>) -> ParseError {
        ParseError { line: self.at.0, column: self.at.1, message: message.into() }
    }

    fn bump(&mut self) -> Result<Tok, ParseError> {
        let (tok, at) = self.lexer.next()?;
        self.at = at;
        Ok(std::mem::replace(&mut self.tok, tok))
    }

    fn describe(tok: &Tok) -> String {
        match tok {
            Tok::Value { name, .. } => format!("value %{name}"),
            Tok::Word(w) => format!("'{w}'"),
            Tok::Number(n) => format!("number {n}"),
            Tok::Str(s) => format!("string \"{s}\""),
            Tok::Punct(c) => format!("'{c}'"),
            Tok::Eof => "end of input".into(),
        }
    }

    fn expect_punct(&mut self, c: char) -> Result<(), ParseError> {
        if self.tok == Tok::Punct(c) {
            self.bump()?;
            Ok(())
        } else {
            Err(self.error_at(format!("expected '{c}', found {}", Self::describe(&self.tok))))
        }
    }

    fn eat_punct(&mut self, c: char) -> Result<bool, ParseError> {
        if self.tok == Tok::Punct(c) {
            self.bump()?;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    fn word(&mut self) -> Result<String, ParseError> {
        match self.bump()? {
            Tok::Word(w) => Ok(w),
            other => Err(self.error_at(format!("expected a word, found {}", Self::describe(&other)))),
        }
    }

    fn string(&mut self) -> Result<String, ParseError> {
        match self.bump()? {
            Tok::Str(s) => Ok(s),
            other => Err(self.error_at(format!("expected a string, found {}", Self::describe(&other)))),
        }
    }

    fn integer(&mut self) -> Result<i64, ParseError> {
        match self.bump()? {
            Tok::Number(n) => n.parse().map_err(|_| self.error_at(format!("expected an integer, found {n}"))),
            other => Err(self.error_at(format!("expected an integer, found {}", Self::describe(&other)))),
        }
    }

    fn usize(&mut self) -> Result<usize, ParseError> {
        let v = self.integer()?;
        usize::try_from(v).map_err(|_| self.error_at(format!("expected a non-negative integer, found {v}")))
    }

    fn value_token(&mut self) -> Result<(bool, String), ParseError> {
        match self.bump()? {
            Tok::Value { name, anonymous } => Ok((anonymous, name)),
            other => Err(self.error_at(format!("expected a value, found {}", Self::describe(&other)))),
        }
    }

    fn use_value(&mut self) -> Result<ValueId, ParseError> {
        let key = self.value_token()?;
        self.values.get(&key).copied().ok_or_else(|| self.error_at(format!("value %{} is not defined", key.1)))
    }

    fn define(&mut self, key: (bool, String), id: ValueId) -> Result<(), ParseError> {
        if !key.0 {
            self.graph.value_mut(id).name = Some(key.1.clone());
        }
        if self.values.insert(key.clone(), id).is_some() {
            return Err(self.error_at(format!("value %{} is defined twice", key.1)));
        }
        Ok(())
    }

    fn tensor_type(&mut self) -> Result<TensorType, ParseError> {
        let name = self.word()?;
        let dtype = DType::from_name(&name).ok_or_else(|| self.error_at(format!("unknown dtype '{name}'")))?;
        self.expect_punct('[')?;
        let mut shape = Vec::new();
        if !self.eat_punct(']')? {
            loop {
                shape.push(self.usize()?);
                if self.eat_punct(']')? {
                    break;
                }
                self.expect_punct(',')?;
            }
        }
        let ty = TensorType::new(dtype, shape);
        ty.check_limits().map_err(|m| self.error_at(m))?;
        Ok(ty)
    }

    /// `{tp = shard(1), dp = partial(sum)}` after a type, if present.
    fn placements(&mut self) -> Result<Option<Vec<Placement>>, ParseError> {
        if self.tok != Tok::Punct('{') {
            return Ok(None);
        }
        self.bump()?;
        let mut placements = self.graph.mesh.replicated();
        loop {
            let axis = self.word()?;
            let index = self
                .graph
                .mesh
                .axes
                .iter()
                .position(|a| a.name == axis)
                .ok_or_else(|| self.error_at(format!("unknown mesh axis '{axis}'")))?;
            self.expect_punct('=')?;
            let kind = self.word()?;
            placements[index] = match kind.as_str() {
                "replicate" => Placement::Replicate,
                "shard" => {
                    self.expect_punct('(')?;
                    let d = self.usize()?;
                    self.expect_punct(')')?;
                    Placement::Shard(d)
                }
                "partial" => {
                    self.expect_punct('(')?;
                    let r = self.word()?;
                    if r != "sum" {
                        return Err(self.error_at(format!("unknown partial reduction '{r}'")));
                    }
                    self.expect_punct(')')?;
                    Placement::PartialSum
                }
                other => return Err(self.error_at(format!("unknown placement '{other}'"))),
            };
            if self.eat_punct('}')? {
                return Ok(Some(placements));
            }
            self.expect_punct(',')?;
        }
    }

    fn attr_value(&mut self) -> Result<Attr, ParseError> {
        match self.bump()? {
            Tok::Number(n) => {
                if let Ok(i) = n.parse::<i64>() {
                    Ok(Attr::Int(i))
                } else {
                    parse_float(&n).map(Attr::Float).ok_or_else(|| self.error_at(format!("bad number {n}")))
                }
            }
            Tok::Word(w) if w == "inf" || w == "nan" => Ok(Attr::Float(parse_float(&w).expect("inf and nan parse"))),
            Tok::Word(w) => Ok(Attr::Word(w)),
            Tok::Punct('[') => {
                let mut vs = Vec::new();
                if !self.eat_punct(']')? {
                    loop {
                        vs.push(self.integer()?);
                        if self.eat_punct(']')? {
                            break;
                        }
                        self.expect_punct(',')?;
                    }
                }
                Ok(Attr::Ints(vs))
            }
            other => Err(self.error_at(format!("expected an attribute value, found {}", Self::describe(&other)))),
        }
    }

    /// `dense<[...]>` or `splat<v>`: the raw literals, converted once the type is known.
    fn constant_literal(&mut self) -> Result<(bool, Vec<String>), ParseError> {
        let kind = self.word()?;
        let splat = match kind.as_str() {
            "splat" => true,
            "dense" => false,
            other => return Err(self.error_at(format!("expected dense<...> or splat<...>, found '{other}'"))),
        };
        self.expect_punct('<')?;
        let mut items = Vec::new();
        let item = |p: &mut Self| -> Result<String, ParseError> {
            match p.bump()? {
                Tok::Number(n) | Tok::Word(n) => Ok(n),
                other => Err(p.error_at(format!("expected a literal, found {}", Self::describe(&other)))),
            }
        };
        if splat {
            items.push(item(self)?);
        } else {
            self.expect_punct('[')?;
            if !self.eat_punct(']')? {
                loop {
                    items.push(item(self)?);
                    if self.eat_punct(']')? {
                        break;
                    }
                    self.expect_punct(',')?;
                }
            }
        }
        self.expect_punct('>')?;
        Ok((splat, items))
    }

    /// A node statement: `%a, %b = op ...` (`outs` the values it defines), or `send ...`
    /// (no outputs; `outs` empty and the op's name already read).
    fn node(&mut self, outs: Vec<(bool, String)>) -> Result<(), ParseError> {
        let mut outs = outs;
        let (op_at, op_name) = if outs.is_empty() {
            (self.at, "send".to_string())
        } else {
            while self.eat_punct(',')? {
                outs.push(self.value_token()?);
            }
            self.expect_punct('=')?;
            (self.at, self.word()?)
        };
        let literal = if op_name == "constant" { Some(self.constant_literal()?) } else { None };
        let mut inputs = Vec::new();
        if matches!(self.tok, Tok::Value { .. }) {
            inputs.push(self.use_value()?);
            while self.eat_punct(',')? {
                inputs.push(self.use_value()?);
            }
        }
        let mut attrs = BTreeMap::new();
        if self.eat_punct('{')? {
            loop {
                let key = self.word()?;
                self.expect_punct('=')?;
                let v = self.attr_value()?;
                attrs.insert(key, v);
                if self.eat_punct('}')? {
                    break;
                }
                self.expect_punct(',')?;
            }
        }
        let mut types = Vec::new();
        let mut placements = Vec::new();
        if !outs.is_empty() {
            self.expect_punct(':')?;
            loop {
                types.push(self.tensor_type()?);
                placements.push(self.placements()?);
                if !self.eat_punct(',')? {
                    break;
                }
            }
        }
        if types.len() != outs.len() {
            return Err(self.error_at(format!("{} outputs but {} types", outs.len(), types.len())));
        }
        let op = match literal {
            Some((splat, items)) => {
                let value = constant_tensor(&types[0], splat, &items).map_err(|m| self.error_at(m))?;
                Op::Constant { value }
            }
            None if op_name == "recv" => {
                let recv = |attrs: &mut BTreeMap<String, Attr>| -> Result<Op, String> {
                    Ok(Op::Recv {
                        from: take_usize(attrs, "from")?,
                        tag: take_usize(attrs, "tag")? as u64,
                        message: take_message(attrs)?,
                        ty: types[0].clone(),
                    })
                };
                recv(&mut attrs).map_err(|m| self.error_at(format!("recv: {m}")))?
            }
            None => build_op(&op_name, &mut attrs).map_err(|m| ParseError {
                line: op_at.0,
                column: op_at.1,
                message: format!("{op_name}: {m}"),
            })?,
        };
        if let Some(key) = attrs.keys().next() {
            return Err(ParseError {
                line: op_at.0,
                column: op_at.1,
                message: format!("{op_name}: unknown attribute '{key}'"),
            });
        }
        let node = self.graph.add_node_typed(op, inputs, types);
        let outputs = self.graph.node(node).outputs.clone();
        for ((key, id), p) in outs.into_iter().zip(outputs).zip(placements) {
            self.define(key, id)?;
            if let Some(p) = p {
                self.graph.value_mut(id).placements = p;
            }
        }
        Ok(())
    }

    fn graph(&mut self) -> Result<(), ParseError> {
        if self.word()? != "graph" {
            return Err(self.error_at("expected 'graph'"));
        }
        self.graph.name = self.string()?;
        if self.tok == Tok::Word("mesh".into()) {
            self.bump()?;
            self.expect_punct('[')?;
            let mut axes = Vec::new();
            loop {
                let name = self.word()?;
                self.expect_punct('=')?;
                let size = self.usize()?;
                if size == 0 {
                    return Err(self.error_at(format!("mesh axis '{name}' has size 0")));
                }
                axes.push(MeshAxis { name, size });
                if self.eat_punct(']')? {
                    break;
                }
                self.expect_punct(',')?;
            }
            self.graph.mesh = Mesh { axes };
        }
        self.expect_punct('{')?;
        // The open `fusion "name" {` block: its name and first node.
        let mut fusion: Option<(String, usize)> = None;
        loop {
            match self.bump()? {
                Tok::Punct('}') if fusion.is_none() => break,
                Tok::Word(w) if w == "input" || w == "param" || w == "state" => {
                    let key = self.value_token()?;
                    self.expect_punct(':')?;
                    let ty = self.tensor_type()?;
                    let placements = self.placements()?;
                    let id = match w.as_str() {
                        "input" => self.graph.add_input(key.1.clone(), ty),
                        "param" => self.graph.add_param(key.1.clone(), ty),
                        _ => self.graph.add_state(key.1.clone(), ty),
                    };
                    if key.0 {
                        return Err(self.error_at(format!("{w} %{} needs a name, not a number", key.1)));
                    }
                    self.define(key, id)?;
                    if let Some(p) = placements {
                        self.graph.value_mut(id).placements = p;
                    }
                }
                Tok::Word(w) if w == "update" => {
                    let target = self.use_value()?;
                    self.expect_punct('=')?;
                    let value = self.use_value()?;
                    self.graph.add_update(target, value);
                }
                Tok::Word(w) if w == "output" => {
                    let name = self.string()?;
                    self.expect_punct('=')?;
                    let v = self.use_value()?;
                    self.graph.add_output(name, v);
                }
                Tok::Value { name, anonymous } => self.node(vec![(anonymous, name)])?,
                Tok::Word(w) if w == "send" => self.node(vec![])?,
                Tok::Word(w) if w == "fusion" && fusion.is_none() => {
                    let name = self.string()?;
                    self.expect_punct('{')?;
                    fusion = Some((name, self.graph.num_nodes()));
                }
                Tok::Punct('}') if fusion.is_some() => {
                    let (name, start) = fusion.take().expect("inside a fusion");
                    self.graph.add_fusion(name, start..self.graph.num_nodes());
                }
                other => return Err(self.error_at(format!("expected a statement, found {}", Self::describe(&other)))),
            }
        }
        if self.tok != Tok::Eof {
            return Err(self.error_at(format!("unexpected {} after the graph", Self::describe(&self.tok))));
        }
        Ok(())
    }
}

fn parse_float(s: &str) -> Option<f64> {
    match s {
        "inf" | "+inf" => Some(f64::INFINITY),
        "-inf" => Some(f64::NEG_INFINITY),
        "nan" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

/// The most bytes a constant in IR text may hold once made: a `splat<v>` of a few characters
/// would otherwise make any size (a larger constant belongs in a parameter).
const MOST_CONSTANT_BYTES: usize = 256 << 20;

fn constant_tensor(ty: &TensorType, splat: bool, items: &[String]) -> Result<Tensor, String> {
    let count = if splat { 1 } else { ty.numel() };
    if items.len() != count {
        return Err(format!("constant has {} elements, its type {ty} needs {count}", items.len()));
    }
    if ty.size_bytes() > MOST_CONSTANT_BYTES {
        return Err(format!(
            "constant of type {ty} holds {} bytes; IR text takes constants of at most {MOST_CONSTANT_BYTES} (256 MiB)",
            ty.size_bytes()
        ));
    }
    let mut bytes = Vec::with_capacity(ty.size_bytes());
    for item in items {
        let chunk = match ty.dtype {
            DType::Bool => match item.as_str() {
                "true" => vec![1],
                "false" => vec![0],
                _ => return Err(format!("bad bool literal '{item}'")),
            },
            DType::I64 => item.parse::<i64>().map_err(|_| format!("bad i64 literal '{item}'"))?.to_le_bytes().to_vec(),
            dtype => {
                let v = parse_float(item).ok_or_else(|| format!("bad {dtype} literal '{item}'"))?;
                // f16/bf16 print as the f32 of their value: exact both ways.
                let v = if matches!(dtype, DType::F16 | DType::BF16) { v as f32 as f64 } else { v };
                autotp_kernels::scalar_bytes(dtype, v)
            }
        };
        bytes.extend(chunk);
    }
    if splat {
        bytes = bytes.repeat(ty.numel());
    }
    Ok(Tensor::from_aligned(ty.clone(), autotp_kernels::AlignedBuf::from_bytes(&bytes)))
}

fn take(attrs: &mut BTreeMap<String, Attr>, key: &str) -> Result<Attr, String> {
    attrs.remove(key).ok_or_else(|| format!("missing attribute '{key}'"))
}

fn take_usizes(attrs: &mut BTreeMap<String, Attr>, key: &str) -> Result<Vec<usize>, String> {
    match take(attrs, key)? {
        Attr::Ints(v) => {
            v.into_iter().map(|x| usize::try_from(x).map_err(|_| format!("'{key}' must be non-negative"))).collect()
        }
        other => Err(format!("'{key}' must be a list of integers, got {other}")),
    }
}

fn take_ints(attrs: &mut BTreeMap<String, Attr>, key: &str) -> Result<Vec<i64>, String> {
    match take(attrs, key)? {
        Attr::Ints(v) => Ok(v),
        other => Err(format!("'{key}' must be a list of integers, got {other}")),
    }
}

fn take_int(attrs: &mut BTreeMap<String, Attr>, key: &str) -> Result<i64, String> {
    match take(attrs, key)? {
        Attr::Int(v) => Ok(v),
        other => Err(format!("'{key}' must be an integer, got {other}")),
    }
}

fn take_usize(attrs: &mut BTreeMap<String, Attr>, key: &str) -> Result<usize, String> {
    let v = take_int(attrs, key)?;
    usize::try_from(v).map_err(|_| format!("'{key}' must be non-negative"))
}

/// An attention's `mask = none | causal | sliding_window` (the last with `window = W`).
fn take_mask(attrs: &mut BTreeMap<String, Attr>) -> Result<AttentionMask, String> {
    match take_word(attrs, "mask")?.as_str() {
        "none" => Ok(AttentionMask::None),
        "causal" => Ok(AttentionMask::Causal),
        "sliding_window" => Ok(AttentionMask::SlidingWindow { window: take_usize(attrs, "window")? }),
        other => Err(format!("unknown attention mask '{other}' (none, causal or sliding_window)")),
    }
}

fn take_message(attrs: &mut BTreeMap<String, Attr>) -> Result<Message, String> {
    let word = take_word(attrs, "message")?;
    Message::from_name(&word)
        .ok_or_else(|| format!("unknown message '{word}' (activation, gradient, shared_gradient or norm_part)"))
}

fn take_float(attrs: &mut BTreeMap<String, Attr>, key: &str) -> Result<f64, String> {
    match take(attrs, key)? {
        Attr::Float(v) => Ok(v),
        Attr::Int(v) => Ok(v as f64),
        other => Err(format!("'{key}' must be a number, got {other}")),
    }
}

fn take_word(attrs: &mut BTreeMap<String, Attr>, key: &str) -> Result<String, String> {
    match take(attrs, key)? {
        Attr::Word(w) => Ok(w),
        other => Err(format!("'{key}' must be a word, got {other}")),
    }
}

fn take_flag(attrs: &mut BTreeMap<String, Attr>, key: &str) -> Result<bool, String> {
    if !attrs.contains_key(key) {
        return Ok(false);
    }
    match take_word(attrs, key)?.as_str() {
        "true" => Ok(true),
        "false" => Ok(false),
        other => Err(format!("'{key}' must be true or false, got {other}")),
    }
}

fn build_op(name: &str, a: &mut BTreeMap<String, Attr>) -> Result<Op, String> {
    if let Some(u) = UnaryOp::from_name(name) {
        return Ok(Op::Unary(u));
    }
    if let Some(b) = BinaryOp::from_name(name) {
        return Ok(Op::Binary(b));
    }
    if let Some(r) = name.strip_prefix("reduce_").and_then(ReduceOp::from_name) {
        return Ok(Op::Reduce { op: r, axes: take_usizes(a, "axes")?, keep_dims: take_flag(a, "keep_dims")? });
    }
    Ok(match name {
        "select" => Op::Select,
        "cast" => {
            let to = take_word(a, "to")?;
            Op::Cast { to: DType::from_name(&to).ok_or_else(|| format!("unknown dtype '{to}'"))? }
        }
        "matmul" => {
            Op::MatMul { transpose_lhs: take_flag(a, "transpose_lhs")?, transpose_rhs: take_flag(a, "transpose_rhs")? }
        }
        "reshape" => Op::Reshape { shape: take_usizes(a, "shape")? },
        "expand" => Op::Expand { shape: take_usizes(a, "shape")? },
        "transpose" => Op::Transpose { perm: take_usizes(a, "perm")? },
        "slice" => {
            Op::Slice { starts: take_usizes(a, "starts")?, ends: take_ints(a, "ends")?, steps: take_ints(a, "steps")? }
        }
        "concat" => Op::Concat { axis: take_usize(a, "axis")? },
        "split" => Op::Split { axis: take_usize(a, "axis")?, sizes: take_usizes(a, "sizes")? },
        "gather" => Op::Gather { axis: take_usize(a, "axis")? },
        "gather_elements" => Op::GatherElements { axis: take_usize(a, "axis")? },
        "gather_nd" => Op::GatherNd,
        "scatter_nd" => {
            let r = take_word(a, "reduction")?;
            Op::ScatterNd {
                reduction: crate::ScatterReduction::from_name(&r).ok_or_else(|| format!("unknown reduction '{r}'"))?,
            }
        }
        "scatter_elements" => Op::ScatterElements { axis: take_usize(a, "axis")?, size: take_usize(a, "size")? },
        "topk" => Op::TopK { axis: take_usize(a, "axis")?, k: take_usize(a, "k")?, largest: take_flag(a, "largest")? },
        "scatter_add" => Op::ScatterAdd { axis: take_usize(a, "axis")?, size: take_usize(a, "size")? },
        "adamw" => Op::AdamW {
            beta1: take_float(a, "beta1")?,
            beta2: take_float(a, "beta2")?,
            eps: take_float(a, "eps")?,
            weight_decay: take_float(a, "weight_decay")?,
        },
        "sgd" => Op::Sgd {
            momentum: take_float(a, "momentum")?,
            weight_decay: take_float(a, "weight_decay")?,
            nesterov: take_flag(a, "nesterov")?,
        },
        "pad" => {
            Op::Pad { begin: take_usizes(a, "begin")?, end: take_usizes(a, "end")?, value: take_float(a, "value")? }
        }
        "triu" | "tril" => Op::Triangle { upper: name == "triu", k: take_int(a, "k")? },
        "cumsum" => Op::CumSum {
            axis: take_usize(a, "axis")?,
            exclusive: take_flag(a, "exclusive")?,
            reverse: take_flag(a, "reverse")?,
        },
        "wait" => Op::Wait,
        "send" => Op::Send { to: take_usize(a, "to")?, tag: take_usize(a, "tag")? as u64, message: take_message(a)? },
        collective
            if ["all_reduce", "all_gather", "reduce_scatter", "shard_slice", "all_to_all", "ring_shift"]
                .contains(&collective.strip_suffix("_start").unwrap_or(collective)) =>
        {
            let start = collective.ends_with("_start");
            let kind = match collective.strip_suffix("_start").unwrap_or(collective) {
                "all_reduce" => Collective::AllReduce,
                "all_gather" => Collective::AllGather { dim: take_usize(a, "dim")? },
                "reduce_scatter" => Collective::ReduceScatter { dim: take_usize(a, "dim")? },
                "all_to_all" => {
                    Collective::AllToAll { split: take_usize(a, "split")?, concat: take_usize(a, "concat")? }
                }
                "ring_shift" => Collective::RingShift { dim: take_usize(a, "dim")? },
                _ => Collective::ShardSlice { dim: take_usize(a, "dim")? },
            };
            Op::Collective { kind, axis: take_word(a, "axis")?, start }
        }
        "attention" | "attention_grad" => {
            let (scale, mask) = (take_float(a, "scale")?, take_mask(a)?);
            let kv_block = if a.contains_key("kv_block") { Some(take_usize(a, "kv_block")?) } else { None };
            if name == "attention" {
                Op::Attention { scale, mask, kv_block }
            } else {
                Op::AttentionGrad { scale, mask, kv_block }
            }
        }
        "softmax" => Op::Softmax { axis: take_usize(a, "axis")? },
        "log_softmax" => Op::LogSoftmax { axis: take_usize(a, "axis")? },
        "layer_norm" => Op::LayerNorm { axis: take_usize(a, "axis")?, eps: take_float(a, "eps")? },
        "rms_norm" => Op::RmsNorm { axis: take_usize(a, "axis")?, eps: take_float(a, "eps")? },
        "gelu" => {
            let approx = if a.contains_key("approx") { take_word(a, "approx")? } else { "none".into() };
            Op::Gelu {
                approx: GeluApprox::from_name(&approx).ok_or_else(|| format!("unknown approximation '{approx}'"))?,
            }
        }
        "cross_entropy" | "nll_loss" => {
            let ignore_index = match take(a, "ignore_index")? {
                Attr::Int(i) => Some(i),
                Attr::Word(w) if w == "none" => None,
                other => return Err(format!("'ignore_index' must be an integer or none, got {other}")),
            };
            let r = take_word(a, "reduction")?;
            let reduction = Reduction::from_name(&r).ok_or_else(|| format!("unknown reduction '{r}'"))?;
            if name == "cross_entropy" {
                Op::CrossEntropy { ignore_index, reduction }
            } else {
                Op::NllLoss { ignore_index, reduction }
            }
        }
        other => return Err(format!("unknown op '{other}'")),
    })
}

/// Parses the text format. The result is not verified; call [`crate::verify()`] for that.
pub fn parse(text: &str) -> Result<Graph, ParseError> {
    let mut lexer = Lexer { src: text.as_bytes(), pos: 0, line: 1, line_start: 0 };
    let (tok, at) = lexer.next()?;
    let mut parser = Parser { lexer, tok, at, graph: Graph::default(), values: BTreeMap::new() };
    parser.graph()?;
    Ok(parser.graph)
}
