//! Paths that a file names relative to its own folder (an ONNX tensor's external data, a
//! checkpoint's files): resolved inside that folder or refused, as ONNX's loader refuses them
//! since CVE-2022-25882. A location is refused when it is absolute, when it has a `..`
//! component, or when it resolves (through symbolic links) outside the folder; a damaged or
//! hostile file then cannot make autotp read `/etc/passwd` as a weight.

use std::path::{Component, Path, PathBuf};

/// Why a location was refused; its message ends the sentence "location ... ".
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum OutsideFolder {
    #[error("is an absolute path; it must be relative to {folder}")]
    Absolute { folder: PathBuf },
    #[error("climbs out of {folder} with '..'")]
    Climbs { folder: PathBuf },
    #[error("resolves to {resolved}, outside {folder} (through a symbolic link)")]
    Linked { folder: PathBuf, resolved: PathBuf },
}

/// `location` (read from a file in `folder`) as a path inside `folder`. A location that does
/// not exist resolves lexically (opening it then fails with its own error).
pub fn inside_folder(folder: &Path, location: &str) -> Result<PathBuf, OutsideFolder> {
    let relative = Path::new(location);
    if relative.has_root() || relative.is_absolute() {
        return Err(OutsideFolder::Absolute { folder: folder.to_path_buf() });
    }
    if relative.components().any(|c| matches!(c, Component::ParentDir | Component::Prefix(_))) {
        return Err(OutsideFolder::Climbs { folder: folder.to_path_buf() });
    }
    let path = folder.join(relative);
    if let (Ok(resolved), Ok(base)) = (path.canonicalize(), canonical_folder(folder)) {
        if !resolved.starts_with(&base) {
            return Err(OutsideFolder::Linked { folder: folder.to_path_buf(), resolved });
        }
    }
    Ok(path)
}

/// `folder` resolved; the current directory for an empty one (a bare file name's folder).
fn canonical_folder(folder: &Path) -> std::io::Result<PathBuf> {
    if folder.as_os_str().is_empty() {
        Path::new(".").canonicalize()
    } else {
        folder.canonicalize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_inside_their_folder_resolve_and_others_are_refused() {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path();
        let folder = root.join("model");
        std::fs::create_dir_all(folder.join("weights")).unwrap();
        std::fs::write(folder.join("weights/data.bin"), b"ok").unwrap();
        std::fs::write(root.join("secret"), b"no").unwrap();
        assert_eq!(inside_folder(&folder, "weights/data.bin"), Ok(folder.join("weights/data.bin")));
        assert_eq!(inside_folder(&folder, "./weights/data.bin"), Ok(folder.join("./weights/data.bin")));
        assert_eq!(inside_folder(&folder, "not-yet-there.bin"), Ok(folder.join("not-yet-there.bin")));
        let absolute = OutsideFolder::Absolute { folder: folder.clone() };
        assert_eq!(inside_folder(&folder, "/etc/passwd"), Err(absolute));
        let climbs = OutsideFolder::Climbs { folder: folder.clone() };
        assert_eq!(inside_folder(&folder, "../../../../etc/passwd"), Err(climbs.clone()));
        assert_eq!(inside_folder(&folder, "weights/../../secret"), Err(climbs));
        std::os::unix::fs::symlink(root.join("secret"), folder.join("link.bin")).unwrap();
        std::os::unix::fs::symlink(root, folder.join("up")).unwrap();
        for linked in ["link.bin", "up/secret"] {
            let refused = inside_folder(&folder, linked).unwrap_err();
            assert!(matches!(refused, OutsideFolder::Linked { .. }), "{linked}: {refused:?}");
            assert!(refused.to_string().contains("secret") && refused.to_string().contains("outside"), "{refused}");
        }
    }
}
