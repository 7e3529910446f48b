//! The operation kinds that the IR and the kernels share: elementwise unary and binary
//! functions, reductions and GELU variants.

use serde::{Deserialize, Serialize};

macro_rules! named_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident => $text:literal),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub enum $name { $($variant),* }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),*];

            /// The name used in the IR text format.
            pub fn name(self) -> &'static str {
                match self { $($name::$variant => $text),* }
            }

            pub fn from_name(name: &str) -> Option<$name> {
                Self::ALL.iter().copied().find(|v| v.name() == name)
            }
        }
    };
}

named_enum!(
    /// Elementwise functions of one tensor. `finite_zero` is `x - x`: 0 where `x` is finite,
    /// NaN where it is not (an optimizer step's finite check).
    UnaryOp {
        Neg => "neg", Abs => "abs", Exp => "exp", Log => "log", Sqrt => "sqrt",
        Rsqrt => "rsqrt", Reciprocal => "reciprocal", Tanh => "tanh", Erf => "erf",
        Sigmoid => "sigmoid", Relu => "relu", Sin => "sin", Cos => "cos", Floor => "floor",
        Ceil => "ceil", Round => "round", Sign => "sign", Not => "not", Softplus => "softplus",
        FiniteZero => "finite_zero",
    }
);

named_enum!(
    /// Elementwise functions of two tensors, with numpy broadcasting.
    BinaryOp {
        Add => "add", Sub => "sub", Mul => "mul", Div => "div", Pow => "pow", Max => "max",
        Min => "min", Mod => "mod", Equal => "equal", Less => "less", LessEqual => "less_equal",
        Greater => "greater", GreaterEqual => "greater_equal", And => "and", Or => "or",
        Xor => "xor",
    }
);

named_enum!(
    /// Reductions over a set of axes.
    ReduceOp { Sum => "sum", Mean => "mean", Max => "max", Min => "min", Prod => "prod" }
);

named_enum!(
    /// The GELU formula: exact (erf) or the tanh approximation.
    GeluApprox { None => "none", Tanh => "tanh" }
);

named_enum!(
    /// How a loss reduces over its positions.
    Reduction { Mean => "mean", Sum => "sum", None => "none" }
);

named_enum!(
    /// How `scatter_nd` combines an update with the element it lands on.
    ScatterReduction { None => "none", Add => "add", Mul => "mul", Max => "max", Min => "min" }
);

impl UnaryOp {
    /// True for ops that are logical on booleans and bitwise on integers (`not`, as `~` in
    /// PyTorch), and not defined on floats.
    pub fn is_logical(self) -> bool {
        matches!(self, UnaryOp::Not)
    }

    /// True for ops whose result is only defined for floating-point inputs.
    pub fn needs_float(self) -> bool {
        !matches!(self, UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign | UnaryOp::Relu | UnaryOp::Not)
    }
}

impl BinaryOp {
    /// True for comparisons, whose result is boolean.
    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinaryOp::Equal | BinaryOp::Less | BinaryOp::LessEqual | BinaryOp::Greater | BinaryOp::GreaterEqual
        )
    }

    /// True for ops that are logical on booleans and bitwise on integers (`and`, `or`, `xor`,
    /// as `&`, `|`, `^` in PyTorch), and not defined on floats.
    pub fn is_logical(self) -> bool {
        matches!(self, BinaryOp::And | BinaryOp::Or | BinaryOp::Xor)
    }
}
