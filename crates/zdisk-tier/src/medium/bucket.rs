//! The object-store calls the tier makes for a whole volume: a listing of
//! its prefix, reading a root object, and the error a failed request
//! becomes. No lock is ever held around them (their callers check).

use std::collections::HashMap;
use std::sync::Arc;

use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::ObjectStore;

use crate::cause::StoreCause;
use crate::error::{Result, TierError};
use crate::location::Location;
use crate::objects::{self, Incarnation, RootObject};

/// What a listing of the volume's prefix found.
pub(crate) struct Listing {
    pub segments: HashMap<Incarnation, u64>,
    /// Root object numbers, ascending.
    pub roots: Vec<u64>,
}

pub(crate) async fn list(store: &Arc<dyn ObjectStore>, location: &Location) -> Result<Listing> {
    let prefix = ObjectPath::from(location.prefix.trim_end_matches('/'));
    let prefix = (!location.prefix.is_empty()).then_some(&prefix);
    let objects: Vec<_> = store
        .list(prefix)
        .try_collect()
        .await
        .map_err(|e| store_error(location, "listing", e))?;
    let mut listing = Listing {
        segments: HashMap::new(),
        roots: Vec::new(),
    };
    for object in objects {
        let name = object.location.as_ref();
        let Some(name) = name.strip_prefix(location.prefix.as_str()) else {
            continue;
        };
        if let Some(key) = objects::parse_segment_name(name) {
            listing.segments.insert(key, object.size);
        } else if let Some(number) = objects::parse_root_name(name) {
            listing.roots.push(number);
        }
    }
    listing.roots.sort_unstable();
    Ok(listing)
}

pub(crate) async fn get_root(
    store: &Arc<dyn ObjectStore>,
    location: &Location,
    number: u64,
) -> Result<RootObject> {
    let key = ObjectPath::from(objects::root_key(&location.prefix, number));
    let bytes = store
        .get(&key)
        .await
        .map_err(|e| match e {
            object_store::Error::NotFound { .. } => {
                TierError::Missing(format!("{}: {key} is gone", location.url))
            }
            e => store_error(location, "reading a root object", e),
        })?
        .bytes()
        .await
        .map_err(|e| store_error(location, "reading a root object", e))?;
    let root = RootObject::decode(&bytes)
        .map_err(|e| TierError::BadObject(format!("{}: {key}: {e}", location.url)))?;
    if root.number != number {
        return Err(TierError::BadObject(format!(
            "{}: {key} says it is root {}",
            location.url, root.number
        )));
    }
    Ok(root)
}

pub(crate) fn store_error(
    location: &Location,
    what: &str,
    error: object_store::Error,
) -> TierError {
    TierError::Bucket {
        url: location.url.clone(),
        doing: what.to_string(),
        cause: Box::new(StoreCause::of(&error, &location.target())),
        note: String::new(),
    }
}
